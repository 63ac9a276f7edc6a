"""The host-memory budget (issue 20): peak anonymous host memory, disk bytes per request and
time against all-resident, with the budget at 100 %, 50 % and 25 % of the offloaded weights.

One process on the fake device. The pipeline is a tiny Wan2.1 whose DiT has 48 blocks with
wide feed-forwards (``tests/test_host_budget.py``'s ``big_wan``: about 308 MB of float32
weights, tensors of at most 3 MiB), saved with ``save_pretrained`` and loaded back with
``Omni`` (so the weights are file-backed memory maps). A request is one denoising step
without guidance, 32x32, 5 frames, ``output_type="pt"``: one DiT forward. Per mode (module,
layer; components ``["dit"]``) and budget, a fresh ``Omni`` is built, one warm-up request
run, and the second measured: wall time of the request, ``offload_stats`` disk bytes, and
the peak over load and both requests of (RssAnon - fake device allocated) minus the same
before loading (``_Peak`` of the test: RssAnon read before and after the device count, the
smaller taken). The page cache holds the model file throughout (the disk is not cold).

Usage (about two minutes on 2 shared CPU cores)::

    HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/host_budget.py
"""

from __future__ import annotations

import ctypes
import gc
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


def main() -> None:
    fake_accelerator.install()
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD fixed (see the test)
    directory = Path(tempfile.mkdtemp(prefix="host-budget-"))
    weights = _save_big_wan(directory, num_layers=48, ffn_dim=32768)
    print(f"DiT weights: {weights} bytes ({weights / 2**20:.1f} MiB)")
    resident = _measure(directory, None, None)
    print(f"all resident: request {resident['seconds']:.3f} s")
    print("| mode | budget | peak anon RSS - device (MiB) | disk-backed (MiB) | disk read / request (MiB) "
          "| request time (s) | vs all-resident | output equal |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("module", "layer"):
        for share in (None, 1.0, 0.5, 0.25):
            budget = None if share is None else int(weights * share)
            row = _measure(directory, mode, budget)
            label = "none" if share is None else f"{share:.0%} ({budget / 2**20:.1f} MiB)"
            print(f"| {mode} | {label} | {row['peak_mib']:.1f} | {row['disk_backed_mib']:.1f} | "
                  f"{row['disk_mib']:.1f} | {row['seconds']:.3f} | "
                  f"{row['seconds'] / resident['seconds']:.2f}x | "
                  f"{torch.equal(row['out'], resident['out'])} |")


if __name__ == "__main__":
    main()
