"""Side by side on one tiny Wan2.2 pipeline: all-resident vs. diffusers' offloads vs. ours.

Runs on the fake accelerator (CPU), so bytes and copy counts are exact and wall times
are only meaningful as ratios within this one process. Every variant loads the same
saved pipeline with ``DiffusionPipeline.from_pretrained`` and runs the same requests;
the table reports per-request averages over the measured (steady-state) requests, after
one warm-up request:

* peak: device peak during the request, weights included (bytes)
* H2D / D2H: bytes copied host->device / device->host (weights and activations)
* copies: tensor copies between host and device
* time: wall time relative to the all-resident run
* max|diff|: largest absolute difference of the output from the all-resident output

Usage::

    PYTHONPATH=src python bench/compare_offload.py [--requests 3] [--steps 2]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch
from diffusers import DiffusionPipeline

from diffusion_offload import ModelLevelOffloadBackend
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines


def _load(path: str) -> DiffusionPipeline:
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _request(pipe: DiffusionPipeline, steps: int) -> np.ndarray:
    kwargs = dict(tiny_pipelines.default_call_kwargs("wan2.2"), num_inference_steps=steps)
    out = pipe(prompt="a red fox in the snow", generator=torch.Generator("cpu").manual_seed(0),
               output_type="np", **kwargs)
    return np.asarray(out.frames, dtype=np.float64)


def _measure(setup: Callable[[DiffusionPipeline], None], path: str, device: torch.device,
             requests: int, steps: int) -> dict[str, float | np.ndarray]:
    gc.collect()
    base = fa.stats()["allocated_bytes"]  # device bytes held before this variant loads
    pipe = _load(path)
    setup(pipe)
    _request(pipe, steps)  # warm-up: the first request pays the cold start
    rows = []
    out = None
    for _ in range(requests):
        gc.collect()
        fa.reset_stats()
        t0 = time.perf_counter()
        out = _request(pipe, steps)
        seconds = time.perf_counter() - t0
        s = fa.stats()
        rows.append((s["peak_bytes"] - base, s["h2d_bytes"], s["d2h_bytes"], s["transfers"], seconds))
    del pipe
    gc.collect()
    avg = np.mean(np.asarray(rows, dtype=np.float64), axis=0)
    return {"peak": avg[0], "h2d": avg[1], "d2h": avg[2], "copies": avg[3], "seconds": avg[4], "out": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    device = fa.install()
    with tempfile.TemporaryDirectory() as tmp:
        path = str(tiny_pipelines.save("wan2.2", f"{tmp}/wan2.2"))
        variants: dict[str, Callable[[DiffusionPipeline], None]] = {
            "all-resident": lambda p: p.to(device),
            "diffusers enable_model_cpu_offload": lambda p: p.enable_model_cpu_offload(device=device),
            "diffusers enable_group_offload (block_level, 1 block)": lambda p: p.enable_group_offload(
                onload_device=device, offload_device=torch.device("cpu"), offload_type="block_level",
                num_blocks_per_group=1),
            "diffusion_offload module [dit, text_encoder]": lambda p: ModelLevelOffloadBackend(
                {"mode": "module", "components": ["dit", "text_encoder"]}, device).enable(p),
        }
        results = {name: _measure(fn, path, device, args.requests, args.steps) for name, fn in variants.items()}
    base = results["all-resident"]
    header = "| variant | peak bytes | H2D bytes | D2H bytes | copies | time / all-resident | max abs diff |"
    print(f"tiny Wan2.2 (transformer + transformer_2 + UMT5 + VAE), {args.steps} steps, "
          f"{args.requests} measured requests after 1 warm-up, per-request averages, fake accelerator\n")
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        diff = float(np.abs(r["out"] - base["out"]).max())
        print(f"| {name} | {r['peak']:,.0f} | {r['h2d']:,.0f} | {r['d2h']:,.0f} | {r['copies']:,.0f} | "
              f"{r['seconds'] / base['seconds']:.2f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
