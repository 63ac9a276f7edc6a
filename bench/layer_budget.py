"""Layer mode with a device-memory budget, and First Block Cache in layer mode (issue 18,
items 3 and 4): H2D bytes per steady request, the planner's prediction, outputs.

One process on the fake device, the setup of ``bench/op_counts.py``: the pipeline is
``tiny_pipelines.build("wan2.2", num_layers=8)``, a request is ``default_call_kwargs
("wan2.2")`` with ``num_inference_steps=4``, ``negative_prompt="blurry"`` (CFG on) and
``output_type="latent"``; two warm-up requests, the third is measured. H2D bytes are the
engine's (``backend.stats``: weight bytes copied host->device).

Budget: ``device_memory_budget`` = the bytes that always stay on the device (the trunks
and the VAE: ``backend.fixed_bytes``) + the two largest streamed blocks + 6 DiT blocks;
the fake device's capacity = that budget + the activation peak measured all resident.
Compared with layer mode without a budget, H2D per request must drop by exactly those 6
blocks times their calls, and equal the planner's prediction (``plan_model(...,
device_memory=capacity, device_memory_budget=budget)``, row ``layer ... + budget``)
within 1 %.

First Block Cache: ``transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))`` on
both DiTs, before and after ``enable``. The skipped blocks (a block's forward called, its
body, ``attn1``, not run) must not stream: H2D = H2D without the cache - the skipped
blocks' bytes + the wasted prefetches' bytes (``stats.wasted_bytes``), with at most one
wasted block per cached forward; outputs equal the same cache without offload, in layer
and in module mode.

Usage (about a minute on 2 shared CPU cores)::

    HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/layer_budget.py
"""

from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend  # noqa: E402
from diffusion_offload.planner.model import load_plan_model  # noqa: E402
from diffusion_offload.planner.plan import plan_model, resolve_request  # noqa: E402
from diffusion_offload.testing import fake_accelerator as fa  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

KIND, LAYERS, STEPS, KEPT, THRESHOLD = "wan2.2", 8, 4, 6, 0.2
DITS = ("transformer", "transformer_2")
LAYER = {"mode": "layer", "components": ["dit", "text_encoder"]}
MODULE = {"mode": "module", "components": ["dit", "text_encoder"]}
DEVICE = fa.install()


def build() -> Any:
    pipe = tiny_pipelines.build(KIND, num_layers=LAYERS)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def request(pipe: Any) -> torch.Tensor:
    kwargs = {**tiny_pipelines.default_call_kwargs(KIND), "num_inference_steps": STEPS}
    out = pipe(prompt="a cat on a mat", negative_prompt="blurry", output_type="latent",
               generator=torch.Generator("cpu").manual_seed(0), **kwargs)
    return out.frames.cpu()


def cache(pipe: Any) -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    for name in DITS:
        getattr(pipe, name).enable_cache(FirstBlockCacheConfig(threshold=THRESHOLD))


def count_bodies(pipe: Any) -> dict[str, int]:
    """Live counts: DiT forwards, cached forwards (tail body not run), skipped blocks."""
    counts = {"forwards": 0, "calls": 0, "bodies": 0, "tails": 0}

    def bump(key: str) -> None:
        counts[key] += 1

    for name in DITS:
        dit = getattr(pipe, name)
        dit.register_forward_pre_hook(lambda m, a: bump("forwards"))
        for block in dit.blocks:
            block.register_forward_pre_hook(lambda m, a: bump("calls"))
            block.attn1.register_forward_pre_hook(lambda m, a: bump("bodies"))
        dit.blocks[-1].attn1.register_forward_pre_hook(lambda m, a: bump("tails"))
    return counts


def steady(pipe: Any, backend: Any = None, counts: dict[str, int] | None = None) -> dict[str, Any]:
    """Two warm-ups, then the measured request: output, engine H2D, wasted bytes, peak."""
    request(pipe)
    request(pipe)
    gc.collect()
    before = backend.stats.snapshot() if backend is not None else None
    start = dict(counts or {})
    allocated = fa.stats()["allocated_bytes"]
    fa.reset_stats()
    out = request(pipe)
    row: dict[str, Any] = {"out": out, "peak": fa.stats()["peak_bytes"], "rest": allocated,
                           "races": fa.stats()["races_detected"]}
    if backend is not None:
        spent = backend.stats.since(before)
        row.update(h2d=spent.h2d_bytes, fallbacks=spent.fallback_loads, d2h=spent.d2h_bytes)
    if isinstance(backend, LayerwiseOffloadBackend):
        row["wasted"] = spent.wasted_bytes
        row["audit"] = backend.audit()
    if counts is not None:
        row["counts"] = {k: v - start.get(k, 0) for k, v in counts.items()}
    return row


def layer(budget: int | None = None, cached: str = "") -> tuple[dict[str, Any], Any]:
    pipe = build()
    if cached == "before":
        cache(pipe)
    backend = LayerwiseOffloadBackend(LAYER, DEVICE, device_memory_budget=budget)
    backend.enable(pipe)
    if cached == "after":
        cache(pipe)
    counts = count_bodies(pipe)
    for name in DITS:
        counts[name] = 0
        getattr(pipe, name).register_forward_pre_hook(
            lambda m, a, n=name: counts.__setitem__(n, counts[n] + 1))
    seqs = backend.streamer.sequences
    sizes = {c: [b.nbytes for b in seq] for c, seq in seqs.items()}  # read at enable
    row = steady(pipe, backend, counts)
    row["sizes"] = sizes
    return row, backend


def main() -> int:
    torch.set_num_threads(1)
    device = DEVICE
    failures: list[str] = []

    def check(ok: bool, what: str) -> str:
        if not ok:
            failures.append(what)
        return "yes" if ok else "**no**"

    # layer mode first, the all-resident references last: with them first, a later layer
    # backend's text-encoder StreamedBlock.nbytes read 0 after its requests (not
    # investigated here; block sizes are read at enable)
    plain, backend = layer()
    dit_block = plain["sizes"]["transformer"][0]
    sizes = sorted((n for seq in plain["sizes"].values() for n in seq), reverse=True)
    # the activation peak, measured: the peak beyond the trunks, the VAE and two blocks
    activations = plain["peak"] - backend.fixed_bytes - sum(sizes[:2])
    budget = backend.fixed_bytes + sum(sizes[:2]) + KEPT * dit_block
    capacity = budget + activations
    del backend
    gc.collect()

    fa.set_capacity(capacity)
    try:
        budgeted, backend = layer(budget)
        kept, backend_fixed = backend.kept, backend.fixed_bytes
        retries = backend.streamer.retries
    finally:
        del backend
        gc.collect()
        fa.set_capacity(None)

    # the planner, on the same pipeline saved to a folder
    with tempfile.TemporaryDirectory() as folder:
        tiny_pipelines.save(KIND, folder, num_layers=LAYERS)
        pm = load_plan_model(folder)
        kw = tiny_pipelines.default_call_kwargs(KIND)
        req = resolve_request(pm, kw["height"], kw["width"], kw["num_frames"], STEPS)
        rows = {r.name: r for r in plan_model(pm, req, capacity, device_kind="fakegpu",
                                              device_memory_budget=budget)}
    planned = rows["layer dit+text_encoder + budget"]
    planned_plain = rows["layer dit+text_encoder k=0"]
    calls = plain["counts"]  # forward calls of each DiT in the measured request

    # First Block Cache in layer and module mode (both orders), then the references
    layer_rows = {order: layer(cached=order)[0] for order in ("after", "before")}
    gc.collect()
    module_rows = {}
    for order in ("before", "after"):
        pipe = build()
        if order == "before":
            cache(pipe)
        backend = ModelLevelOffloadBackend(MODULE, device)
        backend.enable(pipe)
        if order == "after":
            cache(pipe)
        module_rows[order] = steady(pipe, backend)
        backend.disable()
        del backend, pipe
        gc.collect()
    res = steady(build().to(device))
    gc.collect()
    ref_pipe = build().to(device)
    cache(ref_pipe)
    ref = steady(ref_pipe, counts=count_bodies(ref_pipe))
    del ref_pipe
    gc.collect()

    print("## Layer mode with a budget\n")
    print(f"tiny {KIND}, num_layers={LAYERS}, {STEPS} steps, CFG on, output_type='latent'; the third request\n")
    print(f"- budget {budget:,} B = fixed {backend_fixed:,} B (trunks + VAE) "
          f"+ two largest streamed blocks {sum(sizes[:2]):,} B + {KEPT} DiT blocks of {dit_block:,} B; "
          f"capacity {capacity:,} B = budget + activation peak {activations:,} B (layer mode's peak "
          f"without a budget less its trunks, VAE and two blocks; all resident: {res['peak'] - res['rest']:,} B)")
    print(f"- kept: {kept}")
    drop = plain["h2d"] - budgeted["h2d"]
    expected = sum(calls[c] * len(names) for c, names in kept.items()) * dit_block
    print("\n| run | H2D / request | planner | within 1 % | peak | max abs diff vs all resident | fallbacks | races |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for name, row, plan_row in (("layer, no budget", plain, planned_plain), ("layer, budget", budgeted, planned)):
        diff = float((row["out"] - res["out"]).abs().max())
        ok = abs(row["h2d"] - plan_row.h2d_bytes_per_request) <= 0.01 * plan_row.h2d_bytes_per_request
        print(f"| {name} | {row['h2d']:,} | {plan_row.h2d_bytes_per_request:,} | {check(ok, name + ' vs planner')} "
              f"| {row['peak']:,} | {diff:.1e} | {row['fallbacks']} | {row['races']} |")
        check(diff == 0 and row["races"] == 0 and not row["audit"], f"{name}: output, races, audit")
    print(f"\n- H2D drop {drop:,} B = the {KEPT} kept blocks x their calls (transformer {calls['transformer']}, "
          f"transformer_2 {calls['transformer_2']}) x {dit_block:,} B = {expected:,} B: "
          f"{check(drop == expected, 'budget drop')}; peak {budgeted['peak']:,} B <= capacity {capacity:,} B: "
          f"{check(budgeted['peak'] <= capacity and retries == 0, 'capacity')} (OOM retries {retries})")

    print("\n## First Block Cache (threshold 0.2)\n")
    print("| run | H2D / request | no cache - skipped + wasted | skipped blocks | cached forwards "
          "| wasted prefetches | <= 1 per cached forward | max abs diff vs the cache without offload | races |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---:|")
    for order, row in layer_rows.items():
        c = row["counts"]
        skipped = (c["calls"] - c["bodies"]) * dit_block
        cached = c["forwards"] - c["tails"]
        wasted = row["wasted"]
        exact = row["h2d"] == plain["h2d"] - skipped + wasted
        diff = float((row["out"] - ref["out"]).abs().max())
        print(f"| layer, enable_cache {order} enable | {row['h2d']:,} | {plain['h2d'] - skipped + wasted:,} "
              f"({check(exact, order + ' exact')}) | {c['calls'] - c['bodies']} ({skipped:,} B) | {cached} "
              f"| {wasted // dit_block} ({wasted:,} B) | {check(wasted <= cached * dit_block, order + ' wasted')} "
              f"| {diff:.1e} | {row['races']} |")
        same = all(c[k] == ref["counts"][k] for k in ref["counts"])
        check(diff == 0 and row["races"] == 0 and not row["audit"] and same, f"{order}: output")
    for order, row in module_rows.items():
        diff = float((row["out"] - ref["out"]).abs().max())
        ok = check(diff == 0 and row["races"] == 0, "module " + order)
        print(f"| module strict, enable_cache {order} enable | {row['h2d']:,} | | | | | | {diff:.1e} ({ok}) "
              f"| {row['races']} |")
    if failures:
        print(f"\nfailed: {failures}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
