"""The host-memory budget (issue 20): peak anonymous host memory, disk bytes per request and
time against all-resident, with the budget at 100 %, 50 % and 25 % of the offloaded weights.

One process on the fake device. The pipeline is a tiny Wan2.1 whose DiT has 48 blocks with
wide feed-forwards (``tests/test_host_budget.py``'s ``big_wan``: about 308 MB of float32
weights, tensors of at most 3 MiB), saved with ``save_pretrained`` and loaded back with
``Omni`` (so the weights are file-backed memory maps). A request is one denoising step
without guidance, 32x32, 5 frames, ``output_type="pt"``: one DiT forward. Per mode (module,
layer; components ``["dit"]``) and budget, a fresh process runs the all-resident engine once
(its one-time allocations: lazy imports, kernels), then builds an ``Omni``, runs one
warm-up request and measures the second: wall time of the request, ``offload_stats`` disk bytes, and
the peak over load and both requests of (RssAnon - fake device allocated) minus the same
before loading (``_Peak`` of the test: RssAnon read before and after the device count, the
smaller taken). The page cache holds the model file throughout (the disk is not cold).

Usage (about two minutes on 2 shared CPU cores; ``--layers 96 --ffn-dim 81920`` builds the
issue's scale, a 1.5 GB DiT, in about twelve)::

    HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/host_budget.py [--layers N] [--ffn-dim F]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_host_budget import _Peak, _anon, _call, _save_big_wan  # noqa: E402

from diffusion_offload.engine.omni import Omni  # noqa: E402
from diffusion_offload.testing import fake_accelerator  # noqa: E402


def _measure(directory: Path, mode: str | None, budget: int | None) -> dict[str, float]:
    gc.collect()
    baseline = _anon() - fake_accelerator.stats()["allocated_bytes"]
    config = None if mode is None else {"mode": mode, "components": ["dit"]}
    with _Peak() as peak:
        engine = Omni(str(directory), config, device="fakegpu", host_memory_budget=budget,
                      progress=False)
        _call(engine.pipeline)
        before = engine.backend.stats.snapshot() if engine.backend else None
        start = time.perf_counter()
        out = _call(engine.pipeline)
        seconds = time.perf_counter() - start
        used = engine.backend.stats.since(before) if engine.backend else None
    row = {
        "peak_mib": (peak.peak - baseline) / 2**20,
        "seconds": seconds,
        "disk_mib": used.disk_read_bytes / 2**20 if used else 0.0,
        "disk_backed_mib": used.disk_backed_bytes / 2**20 if used else 0.0,
        "out": out,
    }
    engine.close()
    del engine
    gc.collect()  # the engine's cycles: its device and host memory freed before the next run
    return row


def _one(directory: Path, mode: str, share: str, out_file: Path) -> None:
    """One measurement in this (fresh) process; prints its row as JSON."""
    fake_accelerator.install()
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD fixed (see the test)
    weights = int((directory / "weights").read_text())
    budget = None if share == "none" else int(weights * float(share))
    _measure(directory, None, None)  # warm-up: the process's one-time allocations, all resident
    row = _measure(directory, None if mode == "resident" else mode, budget)
    torch.save(row.pop("out").cpu(), out_file)
    print(json.dumps({"budget": budget, **row}))


def main() -> None:
    """Each row in a fresh process, so no run's freed memory shows in another's peak."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48, help="DiT blocks (default 48)")
    parser.add_argument("--ffn-dim", type=int, default=32768,
                        help="feed-forward width (default 32768: 295 MiB with 48 blocks)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="host-budget-"))
    weights = _save_big_wan(directory, num_layers=args.layers, ffn_dim=args.ffn_dim)
    (directory / "weights").write_text(str(weights))
    print(f"DiT weights: {weights} bytes ({weights / 2**20:.1f} MiB)")

    def run(mode: str, share: str) -> tuple[dict, torch.Tensor]:
        out_file = directory / f"out-{mode}-{share}.pt"
        done = subprocess.run(
            [sys.executable, __file__, "--one", str(directory), mode, share, str(out_file)],
            check=True, capture_output=True, text=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out_file)

    resident, want = run("resident", "none")
    print(f"all resident: request {resident['seconds']:.3f} s, peak {resident['peak_mib']:.1f} MiB")
    print("| mode | budget | peak anon RSS - device (MiB) | disk-backed (MiB) | disk read / request (MiB) "
          "| request time (s) | vs all-resident | output equal |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("module", "layer"):
        for share in ("none", "1.0", "0.5", "0.25"):
            row, out = run(mode, share)
            label = "none" if share == "none" else f"{float(share):.0%} ({row['budget'] / 2**20:.1f} MiB)"
            print(f"| {mode} | {label} | {row['peak_mib']:.1f} | {row['disk_backed_mib']:.1f} | "
                  f"{row['disk_mib']:.1f} | {row['seconds']:.3f} | "
                  f"{row['seconds'] / resident['seconds']:.2f}x | {torch.equal(out, want)} |")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--one":
        _one(Path(sys.argv[2]), sys.argv[3], sys.argv[4], Path(sys.argv[5]))
    else:
        main()
