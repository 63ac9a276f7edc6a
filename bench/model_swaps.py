"""What handing the device from one model to another costs (issue 35): swap seconds against
the bytes each swap moves, with and without a host budget (weights left on disk), and the
device ops and host waits the fake device counts.

Three tiny-family models (Wan2.2 text-to-video, Wan2.2 image-to-video, FLUX), widened so a
swap moves megabytes, are saved to a temporary folder and served by one ``ModelPool`` on the
fake device, module mode (DiTs and text encoders offloaded, everything else resting on the
device and put to sleep with the model). The same requests run interleaved (a swap at each)
and back to back (no swap); a swap's cost is the difference a request, and its ``sleep`` +
``wake`` seconds are the pool's own (``ModelCounts.swap_seconds``). Each configuration runs
in its own process.

Run: ``HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/model_swaps.py [--layers N]``.
Absolute seconds on this machine's fake device are CPU copies, not a GPU's: read the ratios,
the bytes and the counts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KINDS = ("wan2.2", "wan2.2-i2v", "flux")


def _save(root: Path, layers: int) -> dict[str, str]:
    from diffusion_offload.testing import tiny_pipelines

    return {kind: str(tiny_pipelines.save(kind, root / kind, num_layers=layers)) for kind in KINDS}


def _request(kind: str, seed: int) -> tuple[Any, Any]:
    import numpy as np
    from PIL import Image

    from diffusion_offload.engine import SamplingParams
    from diffusion_offload.testing import tiny_pipelines

    kw = tiny_pipelines.default_call_kwargs(kind)
    params = SamplingParams(height=kw["height"], width=kw["width"], num_frames=kw.get("num_frames"),
                            num_inference_steps=kw["num_inference_steps"], seed=seed)
    if kind == "wan2.2-i2v":
        x = np.arange(32, dtype=np.int64) * 8
        image = Image.fromarray(np.stack([np.add.outer(x, x) % 256] * 3, axis=-1).astype(np.uint8))
        return {"prompt": "a cat", "image": image}, params
    return "a cat", params


def _one(paths: dict[str, str], budget_share: float | None) -> dict[str, Any]:
    from diffusion_offload.engine import ModelPool, ModelSpec
    from diffusion_offload.testing import fake_accelerator as fa

    fa.install()
    specs = [ModelSpec(k, paths[k]) for k in KINDS]
    budget = None
    if budget_share is not None:
        with ModelPool(specs, device="fakegpu", progress=False) as free:
            held = sum(e.stats.pinned_total_bytes + e.stats.pageable_host_bytes for e in free.engines.values())
        budget = int(budget_share * held)
    with ModelPool(specs, device="fakegpu", progress=False, host_memory_budget=budget) as pool:
        for kind in KINDS:  # warm: every model has run once
            pool.generate(kind, *_request(kind, 1))
        rows: dict[str, Any] = {"budget": budget}
        for name, order in (("back to back", [k for k in KINDS for _ in range(3)]),
                            ("interleaved", [k for _ in range(3) for k in KINDS])):
            before = {k: (c.swaps, c.swap_seconds) for k, c in pool.counts.items()}
            stats0 = {k: e.stats.snapshot() for k, e in pool.engines.items()}
            fa.reset_stats()
            start = time.perf_counter()
            for i, kind in enumerate(order):
                pool.generate(kind, *_request(kind, 1 + i % 2))
            wall = time.perf_counter() - start
            s = fa.stats()
            moved = {k: e.stats.since(stats0[k]) for k, e in pool.engines.items()}
            swaps = sum(c.swaps - before[k][0] for k, c in pool.counts.items())
            rows[name] = {
                "requests": len(order), "wall_s": wall, "swaps": swaps,
                "swap_s": sum(c.swap_seconds - before[k][1] for k, c in pool.counts.items()),
                "h2d_bytes": sum(m.h2d_bytes for m in moved.values()),
                "d2h_bytes": sum(m.d2h_bytes for m in moved.values()),
                "disk_read_bytes": sum(m.disk_read_bytes for m in moved.values()),
                "device_ops": s["device_ops"], "host_waits": s["host_waits"], "copies": s["transfers"],
                "peak_bytes": s["peak_bytes"],
            }
        rows["host_bytes"] = sum(e.stats.pinned_total_bytes + e.stats.pageable_host_bytes + e.stats.cow_bytes
                                 for e in pool.engines.values())
        rows["disk_bytes"] = sum(e.stats.disk_backed_bytes for e in pool.engines.values())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="DiT blocks per model (default 8)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="model-swaps-"))
    paths = _save(root, args.layers)
    print(f"models: {', '.join(KINDS)} ({args.layers} DiT blocks each), module mode, fake device")
    print("| host budget | order | requests | swaps | wall (s) | swap s (sleep+wake) | H2D MiB | D2H B | "
          "disk read MiB | device ops | host waits | copies | peak MiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for share in (None, 0.4):
        done = subprocess.run([sys.executable, __file__, "--one", json.dumps(paths), json.dumps(share)],
                              check=True, capture_output=True, text=True)
        rows = json.loads(done.stdout.strip().splitlines()[-1])
        label = "none" if rows["budget"] is None else f"{rows['budget']:,} B (40 %)"
        for name in ("back to back", "interleaved"):
            r = rows[name]
            print(f"| {label} | {name} | {r['requests']} | {r['swaps']} | {r['wall_s']:.3f} | {r['swap_s']:.3f} | "
                  f"{r['h2d_bytes'] / 2**20:.1f} | {r['d2h_bytes']} | {r['disk_read_bytes'] / 2**20:.1f} | "
                  f"{r['device_ops']} | {r['host_waits']} | {r['copies']} | {r['peak_bytes'] / 2**20:.1f} |")
        a, b = rows["back to back"], rows["interleaved"]
        extra = b["swaps"] - a["swaps"]
        if extra:
            print(f"\n{label}: per extra swap {(b['wall_s'] - a['wall_s']) / extra * 1e3:.1f} ms of wall, "
                  f"{(b['h2d_bytes'] - a['h2d_bytes']) / extra / 2**20:.2f} MiB H2D, "
                  f"{(b['device_ops'] - a['device_ops']) / extra:.0f} device ops, "
                  f"{(b['host_waits'] - a['host_waits']) / extra:.1f} host waits; host copies "
                  f"{rows['host_bytes']:,} B in RAM, {rows['disk_bytes']:,} B on disk\n")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(_one(json.loads(sys.argv[2]), json.loads(sys.argv[3]))))
    else:
        main()
