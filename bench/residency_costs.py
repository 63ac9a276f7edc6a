"""Costs of the residency core, measured on the fake accelerator (no GPU needed).

1. Host memory of ``enable()``: a DiT of >= 400 MB on the host, pinning on (simulated
   in-place registration). Peak RSS growth during ``enable()``, counted from before the
   weights were built, against the weight bytes. The bound (issue 8): growth <= 1.05 x
   weights + 64 MiB, i.e. never a second full copy. Runs in a subprocess so the peak
   (VmHWM) is this measurement's own.
2. Fingerprints: device bytes read and read back per load+evict cycle of an unmodified
   component, and the time of the cycle with fingerprints against the same cycle with
   fingerprinting stubbed out (side by side, same process; a ratio, not seconds, since
   this machine is shared).

Usage::

    python bench/residency_costs.py            # both
    python bench/residency_costs.py host       # only 1
    python bench/residency_costs.py fingerprint

Linux only for part 1 (reads /proc/self/status).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def host_memory_child() -> dict:
    import torch
    from torch import nn

    from diffusion_offload import ModelLevelOffloadBackend, SupportsComponentDiscovery
    from diffusion_offload.testing import fake_accelerator as fa

    dev = fa.install()
    torch.set_num_threads(1)

    class Pipe(nn.Module, SupportsComponentDiscovery):
        _dit_modules = ["transformer"]
        _encoder_modules = ["text_encoder"]
        _vae_modules: list = []
        _resident_modules: list = []

        def __init__(self) -> None:
            super().__init__()
            # 16 x 4096 x 1600 float32 = 419 MB, built in place (no init copies)
            self.transformer = nn.ModuleList(
                nn.Linear(4096, 1600, bias=False, device="meta") for _ in range(16)
            )
            self.transformer.to_empty(device="cpu")
            for p in self.transformer.parameters():
                p.data.fill_(0.5)
            self.text_encoder = nn.Linear(8, 8)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    pipe = Pipe()
    weights = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    built = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, dev)
    backend.enable(pipe)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    growth = peak - base
    return {
        "weight_bytes": weights,
        "rss_growth_bytes": growth,
        "growth_over_weights": round(growth / weights, 4),
        "bound_bytes": int(1.05 * weights + 64 * 2**20),
        "within_bound": growth <= 1.05 * weights + 64 * 2**20,
        "rss_after_build_minus_base": built - base,
        "pinned_bytes": backend.stats.pinned_bytes,
        "pageable_host_bytes": backend.stats.pageable_host_bytes,
        "all_pinned": all(p.is_pinned() for p in pipe.transformer.parameters()),
        "enable_seconds": round(seconds, 3),
    }


def fingerprint_costs() -> dict:
    import torch

    from diffusion_offload import ModelLevelOffloadBackend
    from diffusion_offload.core import residency
    from diffusion_offload.testing import fake_accelerator as fa
    from diffusion_offload.testing.tiny_pipelines import build

    dev = fa.install()
    torch.set_num_threads(1)
    pipe = build("wan2.2", 0)
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit", "text_encoder"]}, dev)
    backend.enable(pipe)
    dit = backend.components["transformer"]
    tensors = sum(len(s.members) for s in dit.slots)

    def cycle(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            dit.load()
            dit.evict()
        return (time.perf_counter() - start) / n

    cycle(3)
    fa.reset_stats()
    before = backend.stats.snapshot()
    with_fp = cycle(20)
    stats = backend.stats.since(before)
    dev_stats = fa.stats()
    # the same cycle with no write check: nothing recorded at load, nothing changed at eviction
    real = (residency.ComponentWeights.record_checks, residency.ComponentWeights.changed)
    residency.ComponentWeights.record_checks = lambda self: None
    residency.ComponentWeights.changed = lambda self, slots: [False] * sum(len(s.members) for s in slots)
    try:
        cycle(3)
        without_fp = cycle(20)
    finally:
        residency.ComponentWeights.record_checks, residency.ComponentWeights.changed = real
    return {
        "component": "tiny wan2.2 transformer",
        "tensors": tensors,
        "weight_bytes": dit.nbytes,
        "per_cycle_fingerprint_device_bytes_read": stats.fingerprint_bytes // 20,
        "per_cycle_fingerprints_read_back": stats.fingerprints // 20,
        "per_cycle_fake_d2h_bytes": dev_stats["d2h_bytes"] // 20,
        "per_cycle_write_back_bytes": stats.d2h_bytes // 20,
        "cycle_time_ratio_with_over_without_fingerprints": round(with_fp / without_fp, 2),
    }


def main() -> None:
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what == "host-child":
        print(json.dumps(host_memory_child()))
        return
    if what in ("all", "host"):
        out = subprocess.run(
            [sys.executable, __file__, "host-child"], capture_output=True, text=True, check=True
        )
        print("host memory of enable():", out.stdout.strip().splitlines()[-1])
    if what in ("all", "fingerprint"):
        print("fingerprint costs:", json.dumps(fingerprint_costs()))


if __name__ == "__main__":
    main()
