"""GPU check: the placement/equality tests on a real device, then transfer bandwidth.

1. Runs ``tests/test_backend.py``, ``tests/test_transfer_hooks.py`` and
   ``tests/test_split.py`` with the ``fake_device`` fixture switched to the real device
   (``DIFFUSION_OFFLOAD_TEST_DEVICE=cuda``). Tests that need the fake accelerator's exact
   byte counters are skipped there (they say so).
2. Builds a random ~4 GB bf16 DiT-like component (16 x Linear(8192, 16384)) plus a
   small text encoder, enables model-level offload, and times with CUDA synchronization:
   load from host copies pinned in place, load from pageable host copies, eviction of
   unmodified weights (no copy; fingerprints only), eviction with write-back of modified
   weights, a load+evict cycle with the fingerprints stubbed out (their cost), and, as the
   naive baseline, ``module.to(device)`` / ``module.to("cpu")`` of the same component.
   It also reports pinned bytes against weight bytes, whether the host storages were
   pinned in place (same data pointers before and after ``enable()``) and how much the
   CUDA caching host allocator grew (0 expected: no ``pin_memory()`` copies).

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
from diffusion_offload.transfer import Mover  # noqa: E402


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


def _host_allocator_bytes() -> int:
    """Bytes the CUDA caching host allocator (``pin_memory()`` copies) holds, or -1."""
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is None:
        return -1
    return int(stats().get("allocated_bytes.current", stats().get("allocated_bytes", -1)))


def measure(gib: float, repeats: int, memory: list[str]) -> list[tuple[str, float, float]]:
    """Transfer timings (name, seconds, GB/s); lines about host memory go to ``memory``."""
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
        ptrs = [p.data_ptr() for p in pipe.transformer.parameters()]
        host_before = _host_allocator_bytes()
        start = time.perf_counter()
        backend.enable(pipe)
        enable_s = time.perf_counter() - start
        if pin:
            in_place = ptrs == [p.data_ptr() for p in pipe.transformer.parameters()]
            memory.append(
                f"pinning in place: weights {nbytes} B, stats.pinned_bytes "
                f"{backend.stats.pinned_bytes} B, pageable {backend.stats.pageable_host_bytes} B, "
                f"every weight is_pinned(): {all(p.is_pinned() for p in pipe.transformer.parameters())}, "
                f"same host storages as before enable: {in_place}, CUDA caching host allocator "
                f"grew by {_host_allocator_bytes() - host_before} B, enable() took {enable_s:.3f} s"
            )
        dit, enc = get_hook(pipe.transformer), get_hook(pipe.text_encoder)
        loads, evicts = [], []
        for _ in range(repeats):
            loads.append(_timed(dit.activate))
            evicts.append(_timed(enc.activate))
        kind = "pinned in place" if pin else "pageable"
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
            real = Mover._fingerprints
            Mover._fingerprints = lambda self, members: [0] * len(members)
            try:
                bare = [_timed(dit.activate) + _timed(enc.activate) for _ in range(repeats)]
            finally:
                Mover._fingerprints = real
            cycle = statistics.median(loads) + statistics.median(evicts)
            results.append(("load+evict cycle without fingerprints (stubbed)", statistics.median(bare), float("nan")))
            memory.append(
                f"fingerprint cost: load+evict cycle {cycle:.4f} s with fingerprints, "
                f"{statistics.median(bare):.4f} s without ({cycle / statistics.median(bare):.2f} x)"
            )
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
    memory: list[str] = []
    for name, seconds, gbps in measure(args.gib, args.repeats, memory):
        rate = "-" if gbps != gbps else f"{gbps:.1f}"
        lines.append(f"| {name} | {seconds:.4f} | {rate} |")
    lines += [""] + [f"* {m}" for m in memory]
    text = "\n".join(lines)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu_check.md").write_text(text + "\n")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
