"""GPU check: the placement/equality tests on a real device, then transfer bandwidth.

1. Runs ``tests/test_backend.py``, ``tests/test_transfer_hooks.py`` and
   ``tests/test_split.py`` with the ``fake_device`` fixture switched to the real device
   (``DIFFUSION_OFFLOAD_TEST_DEVICE=cuda``). Tests that need the fake accelerator's exact
   byte counters are skipped there (they say so).
2. Builds a random ~4 GB bf16 DiT-like component (16 x Linear(8192, 16384)) plus a
   small text encoder, enables model-level offload, and times with CUDA synchronization:
   load from pinned host copies, load from pageable host copies, eviction of unmodified
   weights (no copy), eviction with write-back of modified weights, and, as the naive
   baseline, ``module.to(device)`` / ``module.to("cpu")`` of the same component.

Needs torch >= 2.11 with a GPU and pytest; not diffusers. Run from the repo root::

    PYTHONPATH=src python bench/gpu_check.py [--gib 4] [--repeats 3] [--skip-tests]

Prints a Markdown table; with ``$OUT`` set it also writes ``$OUT/gpu_check.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from diffusion_offload import ModelLevelOffloadBackend, SupportsComponentDiscovery  # noqa: E402
from diffusion_offload.hooks import get_hook  # noqa: E402


class _Big(nn.Module):
    def __init__(self, layers: int, rows: int, cols: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(cols, rows, bias=False, dtype=dtype) for _ in range(layers))
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self, layers: int, rows: int, cols: int) -> None:
        super().__init__()
        self.transformer = _Big(layers, rows, cols, torch.bfloat16)
        self.text_encoder = nn.Linear(64, 64, dtype=torch.bfloat16)


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_tests() -> tuple[int, str]:
    env = dict(os.environ, DIFFUSION_OFFLOAD_TEST_DEVICE="cuda", PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/test_backend.py", "tests/test_transfer_hooks.py", "tests/test_split.py"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return proc.returncode, tail


def measure(gib: float, repeats: int) -> list[tuple[str, float, float]]:
    device = torch.device("cuda", torch.cuda.current_device())
    rows, cols = 16384, 8192
    layers = max(1, round(gib * (1 << 30) / (rows * cols * 2)))
    results: list[tuple[str, float, float]] = []
    for pin in (True, False):
        pipe = _Pipe(layers, rows, cols)
        nbytes = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
        backend = ModelLevelOffloadBackend(
            {"mode": "module", "components": ["dit", "text_encoder"], "pin_memory": pin}, device
        )
        backend.enable(pipe)
        dit, enc = get_hook(pipe.transformer), get_hook(pipe.text_encoder)
        loads, evicts = [], []
        for _ in range(repeats):
            loads.append(_timed(dit.activate))
            evicts.append(_timed(enc.activate))
        kind = "pinned" if pin else "pageable"
        load = statistics.median(loads)
        results.append((f"load DiT from {kind} host copies (H2D)", load, nbytes / load / 1e9))
        evict = statistics.median(evicts)
        results.append((f"evict unmodified DiT ({kind}; no D2H copy)", evict, float("nan")))
        if pin:
            dit.activate()
            with torch.no_grad():
                for p in pipe.transformer.parameters():
                    p.mul_(1)  # bump _version: forces write-back
            wb = _timed(enc.activate)
            results.append(("evict modified DiT (D2H write-back to pinned)", wb, nbytes / wb / 1e9))
        backend.disable()
        del pipe, backend, dit, enc
        torch.cuda.empty_cache()
    naive = _Big(layers, rows, cols, torch.bfloat16)
    to_dev = _timed(lambda: naive.to(device))
    to_host = _timed(lambda: naive.to("cpu"))
    results.append(("baseline module.to(device) from pageable", to_dev, nbytes / to_dev / 1e9))
    results.append(("baseline module.to('cpu') (D2H copy)", to_host, nbytes / to_host / 1e9))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description="GPU placement tests and transfer bandwidth")
    parser.add_argument("--gib", type=float, default=4.0, help="size of the random bf16 DiT in GiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (run on a GPU machine)")
        return 1
    lines = [f"device: {torch.cuda.get_device_name()} | torch {torch.__version__} | "
             f"CUDA {torch.version.cuda}", ""]
    status = 0
    if not args.skip_tests:
        status, tail = run_tests()
        lines += ["placement/equality tests on cuda:", "```", tail, "```", ""]
    lines += ["| operation | seconds (median) | GB/s |", "|---|---:|---:|"]
    for name, seconds, gbps in measure(args.gib, args.repeats):
        rate = "-" if gbps != gbps else f"{gbps:.1f}"
        lines.append(f"| {name} | {seconds:.4f} | {rate} |")
    text = "\n".join(lines)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.md").write_text(text + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
