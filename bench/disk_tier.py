"""The disk tier at the drive's speed (issue 34 item 2): disk-read seconds per request
against a plain sequential read of the same bytes, at the same page-cache state, and
layer mode's request wall against max(compute, read time).

One process per mode on the fake device. The pipeline is ``bench/host_budget.py``'s tiny
Wan2.1 with a wide DiT (``tests/test_host_budget.py``'s ``_save_big_wan``), saved with
``save_pretrained`` and loaded back with ``Omni`` (file-backed weights). A request is one
denoising step without guidance (one DiT forward). Per mode (module, layer; components
``["dit"]``):

1. no budget: a warm-up request, then the measured one: the compute wall;
2. ``host_memory_budget`` = 25 % of the DiT's bytes: a warm-up request, then
   * warm: the measured request (page cache holding the files), then a plain read;
   * cold: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the model's own ``*.safetensors``
     files (nothing else), the measured request; again, then the plain read.

The plain read reads the bytes the request read (every disk-backed slot's file range,
in load order) with ``os.preadv`` into one buffer of the staging ring's chunk size.
Columns: request wall, ``offload_stats`` disk-read seconds and bytes, the plain read's
seconds, their ratio (target <= 1.15), peak RssAnon and RssFile during the request
(``/proc/self/status``, sampled every 2 ms), outputs equal to the no-budget run.

Usage (about 3 minutes on 2 shared CPU cores at the default 295 MiB; ``--layers 96
--ffn-dim 81920`` builds issue 20's 1.5 GB scale)::

    HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/disk_tier.py [--layers N] [--ffn-dim F]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_host_budget import _call, _save_big_wan  # noqa: E402

from diffusion_offload.engine.omni import Omni  # noqa: E402
from diffusion_offload.testing import fake_accelerator  # noqa: E402


def _status() -> dict[str, int]:
    """RssAnon and RssFile of this process, bytes (proc(5))."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


class _Sampler:
    """The peak RssAnon and RssFile while the ``with`` body runs (a 2 ms sampling thread)."""

    def __enter__(self) -> "_Sampler":
        self.peak = _status()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            for k, v in _status().items():
                self.peak[k] = max(self.peak[k], v)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for k, v in _status().items():
            self.peak[k] = max(self.peak[k], v)


def _drop_cache(directory: Path) -> None:
    """``POSIX_FADV_DONTNEED`` on the model's own safetensors files (pages mapped by a
    process stay: the kernel drops only unmapped ones; the disk tier pages its own out of
    the process at enable, ``hostmem.page_out``)."""
    for _ in range(2):  # twice: pages still in the per-CPU LRU caches are skipped once
        for path in directory.rglob("*.safetensors"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        time.sleep(0.1)


def _plain_read(ranges: list[tuple[str, int, int]], chunk: int) -> float:
    """Seconds to read ``ranges`` (path, offset, bytes) in order with ``os.preadv`` into
    one buffer of ``chunk`` bytes."""
    buf = bytearray(chunk)
    view = memoryview(buf)
    fds: dict[str, int] = {}
    start = time.perf_counter()
    for path, offset, n in ranges:
        fd = fds.get(path)
        if fd is None:
            fd = fds[path] = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        done = 0
        while done < n:
            k = os.preadv(fd, [view[: min(chunk, n - done)]], offset + done)
            if k <= 0:
                raise OSError(f"{path}: short read")
            done += k
    seconds = time.perf_counter() - start
    for fd in fds.values():
        os.close(fd)
    return seconds


def _request(engine: Omni) -> tuple[float, torch.Tensor, dict[str, int], Any]:
    before = engine.backend.stats.snapshot()
    with _Sampler() as rss:
        start = time.perf_counter()
        out = _call(engine.pipeline)
        wall = time.perf_counter() - start
    return wall, out, rss.peak, engine.backend.stats.since(before)


def _one(directory: Path, mode: str) -> dict[str, Any]:
    fake_accelerator.install()
    weights = int((directory / "weights").read_text())
    config = {"mode": mode, "components": ["dit"]}
    plain = Omni(str(directory), config, device="fakegpu", progress=False)
    _call(plain.pipeline)
    compute, want, _, _ = _request(plain)
    plain.close()
    del plain
    gc.collect()
    budget = weights // 4
    engine = Omni(str(directory), config, device="fakegpu", host_memory_budget=budget, progress=False)
    _call(engine.pipeline)
    disk = engine.backend.mover.disk
    ranges = disk.file_ranges()
    rows: dict[str, Any] = {"mode": mode, "budget": budget, "weights": weights, "compute_s": compute}
    for state in ("warm", "cold"):
        if state == "cold":
            _drop_cache(directory)
        wall, out, peak, used = _request(engine)
        if state == "cold":
            _drop_cache(directory)
        read = _plain_read(ranges, disk.ring.chunk)
        rows[state] = {
            "wall_s": wall, "disk_read_s": used.disk_read_seconds, "disk_read_bytes": used.disk_read_bytes,
            "plain_read_s": read, "plain_bytes": sum(n for *_, n in ranges),
            "rss_anon": peak["RssAnon"], "rss_file": peak["RssFile"], "equal": bool(torch.equal(out, want)),
            "staging_copies": used.staging_copies, "staging_waits": used.staging_waits,
        }
    s = engine.backend.stats
    gc.collect()
    rows["pinned"] = {  # issue 34 item 4: every pinned byte counted, within the budget
        "pinned": s.pinned_total_bytes, "overhead": s.pinned_overhead_bytes, "ring": disk.ring.charged,
        "shared": s.shared_pinned_bytes, "pageable": s.pageable_host_bytes,
        "reserved": engine.backend.tier_plan.overhead_bytes,
        "alive": torch.fakegpu.pinned_host_bytes(),  # the fake device's own count, as CUDA holds it
    }
    engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=48, help="DiT blocks (default 48)")
    parser.add_argument("--ffn-dim", type=int, default=32768, help="feed-forward width (default 32768)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="disk-tier-"))
    weights = _save_big_wan(directory, num_layers=args.layers, ffn_dim=args.ffn_dim)
    (directory / "weights").write_text(str(weights))
    print(f"DiT weights: {weights:,} bytes ({weights / 2**20:.1f} MiB); budget 25 %")
    print("| mode | cache | request wall (s) | compute, no budget (s) | disk-read s / request | "
          "plain read (s) | ratio | disk MiB | peak RssAnon (MiB) | peak RssFile (MiB) | "
          "staging copies / waits | equal |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    pinned_rows = []
    for mode in ("module", "layer"):
        done = subprocess.run([sys.executable, __file__, "--one", str(directory), mode],
                              check=True, capture_output=True, text=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        pinned_rows.append((mode, row["budget"], row["pinned"]))
        for state in ("warm", "cold"):
            r = row[state]
            print(f"| {mode} | {state} | {r['wall_s']:.3f} | {row['compute_s']:.3f} | "
                  f"{r['disk_read_s']:.3f} | {r['plain_read_s']:.3f} | "
                  f"{r['disk_read_s'] / r['plain_read_s']:.2f} | {r['disk_read_bytes'] / 2**20:.1f} | "
                  f"{r['rss_anon'] / 2**20:.1f} | {r['rss_file'] / 2**20:.1f} | "
                  f"{r['staging_copies']} / {r['staging_waits']} | {r['equal']} |")
        if mode == "layer":
            for state in ("warm", "cold"):
                r = row[state]
                bound = 1.1 * max(row["compute_s"], r["plain_read_s"])
                print(f"\nlayer, {state}: request wall {r['wall_s']:.3f} s vs 1.1 x max(compute "
                      f"{row['compute_s']:.3f}, read {r['plain_read_s']:.3f}) = {bound:.3f} s: "
                      f"{'met' if r['wall_s'] <= bound else 'not met'}")
    print("\n| mode | budget | pinned_total_bytes | of it overhead | ring | check weights | other buffers, "
          "padding | planned room for them | pinned alive (fake device) | pinned + pageable within budget |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for mode, budget, p in pinned_rows:
        other = p["overhead"] - p["ring"] - p["shared"]
        print(f"| {mode} | {budget:,} | {p['pinned']:,} | {p['overhead']:,} | {p['ring']:,} | {p['shared']:,} | "
              f"{other:,} | {p['reserved']:,} | {p['alive']:,} | "
              f"{'yes' if p['pinned'] + p['pageable'] <= budget else 'NO'} |")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(_one(Path(sys.argv[2]), sys.argv[3])))
    else:
        main()
