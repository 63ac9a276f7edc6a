"""Device ops and host waits per steady request, per offload strategy (issue 18).

One process on the fake device; for every strategy, in turn, a freshly built identical
pipeline (``tiny_pipelines.build("wan2.2", num_layers=8)``: two DiTs of 8 blocks, a text
encoder, a VAE) is set up, runs two warm-up requests and a third, measured one, and is
freed before the next strategy is built, so that the peak is this strategy's own. A
request is ``pipe(prompt="a cat on a mat", negative_prompt="blurry" (CFG on),
**default_call_kwargs("wan2.2"), num_inference_steps=4, output_type="latent",
generator=torch.Generator("cpu").manual_seed(0))`` and reading the latents back to the
host (``.cpu()``: one device->host copy, the same in every strategy).

Strategies:

* all resident: ``pipe.to(device)``
* diffusers group offload ``block_level``, 1 block per group, without and with
  ``use_stream=True``: set up as ``bench/layer_offload.py`` does (``enable_group_offload``
  on each DiT, ``apply_group_offloading(block_modules=["encoder"])`` on the text encoder,
  the VAE on the device)
* ours, module strict: ``ModelLevelOffloadBackend({"mode": "module", "components": ["dit",
  "text_encoder"]}, device)``
* ours, module with a budget: the same with ``device_memory_budget`` = the bytes that stay
  on the device anyway (the VAE) + the two largest of the three offloaded groups
  (``text_encoder``, ``transformer``, ``transformer_2``): any two fit, never all three, so
  each stage evicts at most one group and the policy keeps the one used soonest
* ours, layer: ``LayerwiseOffloadBackend({"mode": "layer", "components": ["dit",
  "text_encoder"]}, device)`` (prefetch on, write check on)
* ours, layer with ``check_writes=False`` (a keyword argument of
  ``LayerwiseOffloadBackend``; there is no such key in ``core/config.py``)
* ours, module strict and layer, on the pipeline saved with ``save_pretrained`` and loaded
  back (``from_pretrained``: file-backed weights), without a host budget and with
  ``host_memory_budget`` = 40 % of the DiTs' and text encoder's bytes (issue 34): the rest
  stays on disk and each load packs it into arenas through the staging ring. Their
  targets: device ops <= 1.15 x the same mode from files without a budget, host waits <=
  that row's + one per staging-buffer reuse, copies <= that row's + one per staging chunk

Columns per measured request, all exact (``fake_accelerator.stats()``, zeroed before it):
device ops (``device_ops``: kernels and copies a GPU would launch), their ratio to all
resident, host waits (``host_waits``: blocking device->host reads, synchronizes, queries),
copies (``transfers``: tensor copies between host and device), H2D and D2H bytes, peak
device bytes (this strategy's resting weights included; nothing else is alive), max|diff|
of the latents vs all resident (must be 0: bit-equal) and races detected over all three
requests (must be 0).

The targets of the issue are computed from the run itself: DiT and text-encoder forwards
are counted with ``register_forward_pre_hook`` on ``transformer``, ``transformer_2`` and
``text_encoder`` (every call of the module, whoever wraps its ``forward``); block loads
are layer mode's ``stats.prefetches + stats.fallback_loads`` (checked against the calls of
``BlockStreamer._load``); component loads are module mode's ``stats.loads`` (loads that
moved a tensor; ``load_async`` prefetches are among them); transitions are the changes of
component between consecutive forwards, counted cyclically (the measured request follows
an identical one, so its first forward is a transition from the last one).

The breakdown (below the table) attributes each device op, host wait and copy of ours to
the innermost engine function running when it was issued (``SequentialOffloadHook``,
``ComponentWeights``, ``Mover``, ``BlockStreamer``, ``MemoryPolicy`` methods and
``core.writes.fingerprints`` and ``core.arena.sums`` wherever they were imported, wrapped for the run; "pipeline" is everything outside them), with the
number of calls and the cost per call including its callees, so that the cost per
component load (``ComponentWeights.load``), eviction (``ComponentWeights.evict``) or block
release (``BlockStreamer._release``) reads off directly. ``Stream``/``Event``
``synchronize()``/``query()`` calls are counted by kind too.

A strategy that fails is reported as such and the others still run; the exit status is 1
if any failed, differs from all resident or raced.

Usage (about 40 s on 2 shared CPU cores)::

    HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/op_counts.py [--json op_counts.json]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import layer_offload  # noqa: E402  (bench/layer_offload.py: its group-offload setup)

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend  # noqa: E402
from diffusion_offload.core import arena, hooks, policy, residency, streamer, transfer, writes  # noqa: E402
from diffusion_offload.testing import fake_accelerator as fa  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

KIND = "wan2.2"
LAYERS = 8
STEPS = 4
SELECT = ["dit", "text_encoder"]
DITS = ("transformer", "transformer_2")
ENCODERS = ("text_encoder",)
PROMPT = {"prompt": "a cat on a mat", "negative_prompt": "blurry"}
RESIDENT = "all resident"
LAYER = "ours layer"
MODULE = "ours module strict"
HOST_FRACTION = 0.4
"""The host budget of the host-budget rows: this fraction of the offloaded weights."""
MODULE_FILES = "ours module strict, from files"
MODULE_HOST = "ours module strict, host budget 40 %"
LAYER_FILES = "ours layer, from files"
LAYER_HOST = "ours layer, host budget 40 %"

# ------------------------------------------------------------------ attribution


# (class or module, attribute): the engine functions the breakdown attributes to
_WRAPPED: list[tuple[Any, str]] = [
    (hooks.SequentialOffloadHook, "pre_forward"),
    (hooks.SequentialOffloadHook, "activate"),
    (hooks.SequentialOffloadHook, "order_pending"),
    (hooks.SequentialOffloadHook, "_to_device"),
    (residency.ComponentWeights, "load"),
    (residency.ComponentWeights, "load_async"),
    (residency.ComponentWeights, "finish_load"),
    (residency.ComponentWeights, "order_pending"),
    (residency.ComponentWeights, "evict"),
    (residency.ComponentWeights, "sync"),
    (residency.ComponentWeights, "load_slots"),
    (transfer.Mover, "load"),
    (transfer.Mover, "evict"),
    (transfer.Mover, "place"),
    (transfer.Mover, "load_arena"),
    (residency.ComponentWeights, "record_checks"),
    (residency.ComponentWeights, "changed"),
    (streamer.BlockStreamer, "before"),
    (streamer.BlockStreamer, "after"),
    (streamer.BlockStreamer, "_wait"),
    (streamer.BlockStreamer, "_load"),
    (streamer.BlockStreamer, "_release"),
    (streamer.BlockStreamer, "_changed"),
    (streamer.BlockStreamer, "_verify_carried"),
    (streamer.BlockStreamer, "_drop_prefetch"),
    (streamer.BlockStreamer, "_sweep"),
    (streamer.BlockStreamer, "_enter"),
    (streamer.BlockStreamer, "_exit"),
    (policy.MemoryPolicy, "prefetch_next"),
    (policy.MemoryPolicy, "order_pending"),
]

_stack: list[list[int]] = []  # per active wrapped call: ops, waits, copies of its children
# name -> [calls, device ops, host waits, copies (its own), then the same three inclusive]
breakdown: dict[str, list[int]] = {}
not_wrapped: list[str] = []
# host waits that are calls on streams and events, by kind (counted here, per request)
stream_calls: dict[str, int] = {}


def _now() -> tuple[int, int, int]:
    s = fa.stats()
    return s["device_ops"], s["host_waits"], s["transfers"]


def _attributed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, counting what it spends itself (its wrapped callees' share excluded)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = _now()
        children = [0, 0, 0]
        _stack.append(children)
        try:
            return fn(*args, **kwargs)
        finally:
            _stack.pop()
            spent = [b - a for a, b in zip(start, _now())]
            row = breakdown.setdefault(name, [0] * 7)
            row[0] += 1
            for i in range(3):
                row[i + 1] += spent[i] - children[i]
                row[i + 4] += spent[i]
            if _stack:
                for i in range(3):
                    _stack[-1][i] += spent[i]

    return wrapper


def install_attribution() -> None:
    """Wrap the engine functions of ``_WRAPPED`` (those that exist in this version)."""
    for owner, attr in _WRAPPED:
        fn = owner.__dict__.get(attr)
        name = f"{owner.__name__}.{attr}"
        if isinstance(fn, staticmethod):
            setattr(owner, attr, staticmethod(_attributed(name, fn.__func__)))
        elif callable(fn) and not isinstance(fn, classmethod):
            setattr(owner, attr, _attributed(name, fn))
        else:
            not_wrapped.append(name)
    for cls in (fa.Stream, fa.Event):
        for attr in ("synchronize", "query"):
            real_call = getattr(cls, attr)

            key = f"{cls.__name__}.{attr}"

            def counted(self: Any, _real: Any = real_call, _key: str = key) -> Any:
                stream_calls[_key] = stream_calls.get(_key, 0) + 1
                return _real(self)

            setattr(cls, attr, counted)
    for source, attr in ((writes, "fingerprints"), (arena, "sums")):
        real = getattr(source, attr, None)
        if real is None:
            not_wrapped.append(attr)
            continue
        wrapped = _attributed(attr, real)
        for name, mod in list(sys.modules.items()):  # every module that imported it
            if name.startswith("diffusion_offload.") and getattr(mod, attr, None) is real:
                setattr(mod, attr, wrapped)


# --------------------------------------------------------------------- strategies


@dataclass
class Strategy:
    """One strategy, set up: its pipeline, what keeps it alive, its measured request."""

    name: str
    pipe: Any = None
    backend: Any = None
    note: str = ""
    row: dict[str, Any] = field(default_factory=dict)
    out: np.ndarray | None = None


def _build() -> Any:
    pipe = tiny_pipelines.build(KIND, num_layers=LAYERS)
    pipe.set_progress_bar_config(disable=True)
    return pipe


_SAVED: dict[str, Path] = {}


def _from_files() -> Any:
    """The same pipeline saved once with ``save_pretrained`` and loaded back with
    ``DiffusionPipeline.from_pretrained``: its weights are file-backed (safetensors memory
    maps), the only weights a host budget can leave on disk."""
    from diffusers import DiffusionPipeline

    if "dir" not in _SAVED:
        directory = Path(tempfile.mkdtemp(prefix="op-counts-"))
        _build().save_pretrained(directory)
        _SAVED["dir"] = directory
    pipe = DiffusionPipeline.from_pretrained(_SAVED["dir"])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _host_budget() -> tuple[int, str]:
    """``HOST_FRACTION`` of the offloaded components' bytes (DiTs and text encoder)."""
    pipe = _build()
    total = sum(
        p.numel() * p.element_size()
        for name in (*DITS, *ENCODERS)
        for p in [*getattr(pipe, name).parameters(), *getattr(pipe, name).buffers()]
    )
    budget = int(total * HOST_FRACTION)
    return budget, (
        f"host_memory_budget {budget:,} B = {HOST_FRACTION:.0%} of the {total:,} B of the "
        "DiTs and text encoder"
    )


def _budget_two_of_three(device: torch.device) -> tuple[int, str]:
    """The budget that holds the resident components and any two of the three groups."""
    pipe = _build()
    probe = ModelLevelOffloadBackend({"mode": "module", "components": SELECT}, device)
    probe.enable(pipe)
    sizes = {n: c.evictable_bytes for n, c in probe.components.items() if c.selected}
    fixed = sum(c.nbytes for c in probe.components.values() if not c.selected)
    probe.disable()
    del probe, pipe
    gc.collect()
    two = max(sizes[a] + sizes[b] for a in sizes for b in sizes if a != b)
    assert two < sum(sizes.values()), sizes
    why = (
        f"budget {fixed + two:,} B = resident {fixed:,} B + the two largest groups "
        f"({', '.join(f'{n} {b:,} B' for n, b in sizes.items())}: any two fit, not all three)"
    )
    return fixed + two, why


def setups(device: torch.device) -> list[tuple[str, Callable[[], Strategy]]]:
    """(name, set-up function) per strategy, in the order they are measured."""
    module = {"mode": "module", "components": SELECT}
    layer = {"mode": "layer", "components": SELECT}
    group = layer_offload._setups(KIND, LAYERS, device)

    def resident() -> Strategy:
        return Strategy(RESIDENT, _build().to(device))

    def diffusers(name: str, key: str) -> Callable[[], Strategy]:
        def setup() -> Strategy:
            v = group[key]()
            return Strategy(name, v.pipe, v.keep, v.note)

        return setup

    def ours(
        name: str, make: Callable[[], Any], note: str = "", build: Callable[[], Any] = _build
    ) -> Callable[[], Strategy]:
        def setup() -> Strategy:
            pipe = build()
            backend = make()
            backend.enable(pipe)
            return Strategy(name, pipe, backend, note)

        return setup

    def host(cls: Any, config: dict[str, Any], name: str) -> Callable[[], Strategy]:
        def setup() -> Strategy:
            budget, why = _host_budget()
            return ours(name, lambda: cls(config, device, host_memory_budget=budget), why, _from_files)()

        return setup

    def budgeted() -> Strategy:
        budget, why = _budget_two_of_three(device)
        return ours(
            "ours module budget (2 of 3 groups)",
            lambda: ModelLevelOffloadBackend(module, device, device_memory_budget=budget),
            why,
        )()

    return [
        (RESIDENT, resident),
        (
            "diffusers group block_level",
            diffusers("diffusers group block_level", "diffusers group block_level (1 block)"),
        ),
        (
            "diffusers group block_level, use_stream",
            diffusers(
                "diffusers group block_level, use_stream",
                "diffusers group block_level (1 block), use_stream",
            ),
        ),
        (MODULE, ours(MODULE, lambda: ModelLevelOffloadBackend(module, device))),
        ("ours module budget (2 of 3 groups)", budgeted),
        (LAYER, ours(LAYER, lambda: LayerwiseOffloadBackend(layer, device))),
        (
            "ours layer, check_writes=False",
            ours(
                "ours layer, check_writes=False",
                lambda: LayerwiseOffloadBackend(layer, device, check_writes=False),
            ),
        ),
        (MODULE_FILES, ours(MODULE_FILES, lambda: ModelLevelOffloadBackend(module, device),
                            build=_from_files)),
        (MODULE_HOST, host(ModelLevelOffloadBackend, module, MODULE_HOST)),
        (LAYER_FILES, ours(LAYER_FILES, lambda: LayerwiseOffloadBackend(layer, device),
                           build=_from_files)),
        (LAYER_HOST, host(LayerwiseOffloadBackend, layer, LAYER_HOST)),
    ]


# ------------------------------------------------------------------- measurement


def _request(pipe: Any) -> np.ndarray:
    kwargs = {**tiny_pipelines.default_call_kwargs(KIND), "num_inference_steps": STEPS}
    out = pipe(
        **PROMPT, output_type="latent", generator=torch.Generator("cpu").manual_seed(0), **kwargs
    )
    value = getattr(out, "images", None)
    value = out.frames if value is None else value
    return value.cpu().double().numpy()


def _transitions(stages: list[str]) -> int:
    """Changes of component between consecutive forwards, cyclically (steady requests)."""
    return sum(1 for i in range(len(stages)) if stages[i] != stages[i - 1]) if stages else 0


def measure(name: str, setup: Callable[[], Strategy]) -> Strategy:
    gc.collect()
    base = fa.stats()["allocated_bytes"]
    fa.reset_stats()
    t0 = time.perf_counter()
    st = setup()
    _request(st.pipe)  # warm-up 1: cold start, order learning
    _request(st.pipe)  # warm-up 2: layer mode learns what follows the last DiT forward
    warm_races = fa.stats()["races_detected"]
    gc.collect()
    rest = fa.stats()["allocated_bytes"] - base
    forwards: list[str] = []
    handles = [
        getattr(st.pipe, n).register_forward_pre_hook(lambda m, a, n=n: forwards.append(n))
        for n in (*DITS, *ENCODERS)
        if isinstance(getattr(st.pipe, n, None), torch.nn.Module)
    ]
    ours = isinstance(st.backend, (ModelLevelOffloadBackend, LayerwiseOffloadBackend))
    engine = st.backend.stats.snapshot() if ours else None
    breakdown.clear()
    stream_calls.clear()
    fa.reset_stats()
    st.out = _request(st.pipe)
    s = fa.stats()
    spent_breakdown = {k: list(v) for k, v in breakdown.items()}
    spent_stream_calls = dict(stream_calls)
    for h in handles:
        h.remove()
    row: dict[str, Any] = {
        "strategy": name,
        "note": st.note,
        "device_ops": s["device_ops"],
        "host_waits": s["host_waits"],
        "copies": s["transfers"],
        "h2d_bytes": s["h2d_bytes"],
        "d2h_bytes": s["d2h_bytes"],
        "peak_bytes": s["peak_bytes"] - base,
        "resting_bytes": rest,
        "synchronizes": s["synchronizes"],
        "stream_waits": s["stream_waits"],
        "events": s["events"],
        "stream_event_calls": spent_stream_calls,
        "races": warm_races + s["races_detected"],
        "dit_forwards": sum(1 for f in forwards if f in DITS),
        "text_encoder_forwards": sum(1 for f in forwards if f in ENCODERS),
        "transitions": _transitions(forwards),
        "forward_order": _collapse(forwards),
    }
    if engine is not None:
        e = st.backend.stats.since(engine)
        row["engine"] = {k: v for k, v in e.as_dict().items() if k != "transfer_seconds"}
        row["component_loads"] = e.loads
        row["component_evictions"] = e.evictions
        if isinstance(st.backend, LayerwiseOffloadBackend):
            row["block_loads"] = e.prefetches + e.fallback_loads
            calls = spent_breakdown.get("BlockStreamer._load", [None])[0]
            row["block_loads_by_calls"] = calls
            row["trunk_loads"] = e.loads - row["block_loads"]
        row["breakdown"] = spent_breakdown
    st.row = row
    # free this strategy before the next one is built (its peak is then its own)
    st.pipe = st.backend = None
    gc.collect()
    row["leaked_bytes"] = fa.stats()["allocated_bytes"] - base
    print(f"  {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return st


def _collapse(forwards: list[str]) -> list[str]:
    """The forwards with consecutive repeats folded: ``["text_encoder x2", ...]``."""
    out: list[list[Any]] = []
    for f in forwards:
        if out and out[-1][0] == f:
            out[-1][1] += 1
        else:
            out.append([f, 1])
    return [f"{f} x{n}" for f, n in out]


def targets(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two target rows, with limits from the run itself, and whether they are met."""
    res = rows.get(RESIDENT)
    out: list[dict[str, Any]] = []
    if res is None:
        return out
    layer = rows.get(LAYER)
    if layer is not None:
        fw = layer["dit_forwards"] + layer["text_encoder_forwards"]
        out.append(
            _target(
                "layer (checks on)",
                layer,
                res,
                waits=res["host_waits"] + fw,
                copies=layer["block_loads"] + fw + res["copies"],
                waits_rule=f"resident {res['host_waits']} + {fw} forwards",
                copies_rule=(
                    f"{layer['block_loads']} block loads + {fw} forwards + resident "
                    f"{res['copies']}"
                ),
            )
        )
    module = rows.get(MODULE)
    if module is not None:
        tr = module["transitions"]
        out.append(
            _target(
                "module strict",
                module,
                res,
                waits=res["host_waits"] + 2 * tr,
                copies=module["component_loads"] + 2 * tr + res["copies"],
                waits_rule=f"resident {res['host_waits']} + 2 x {tr} transitions",
                copies_rule=(
                    f"{module['component_loads']} component loads + 2 x {tr} transitions "
                    f"+ resident {res['copies']}"
                ),
            )
        )
    for plain, budgeted, mode in ((MODULE_FILES, MODULE_HOST, "module"), (LAYER_FILES, LAYER_HOST, "layer")):
        base, row = rows.get(plain), rows.get(budgeted)
        if base is None or row is None:
            continue
        e = row["engine"]
        out.append(
            _target(
                f"{mode}, host budget (issue 34)",
                row,
                base,
                waits=base["host_waits"] + e["staging_waits"],
                copies=base["copies"] + e["staging_copies"],
                waits_rule=f"{plain} {base['host_waits']} + {e['staging_waits']} staging-buffer reuses",
                copies_rule=f"{plain} {base['copies']} + {e['staging_copies']} staging chunks",
                ops_rule=f"1.15 x {plain}",
            )
        )
    return out


def _target(
    name: str,
    row: dict[str, Any],
    res: dict[str, Any],
    waits: int,
    copies: int,
    waits_rule: str,
    copies_rule: str,
    ops_rule: str = "1.15 x resident",
) -> dict[str, Any]:
    ops = int(1.15 * res["device_ops"])
    return {
        "target": name,
        "device_ops_max": ops,
        "device_ops_rule": ops_rule,
        "device_ops": row["device_ops"],
        "device_ops_met": row["device_ops"] <= ops,
        "host_waits_max": waits,
        "host_waits_rule": waits_rule,
        "host_waits": row["host_waits"],
        "host_waits_met": row["host_waits"] <= waits,
        "copies_max": copies,
        "copies_rule": copies_rule,
        "copies": row["copies"],
        "copies_met": row["copies"] <= copies,
    }


# ------------------------------------------------------------------------ output


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    res = next((r for r in rows if r["strategy"] == RESIDENT and "error" not in r), None)
    if res is None:
        return "all resident failed: " + str(rows[0].get("error"))
    lines = [
        (
            f"tiny {KIND}, num_layers={LAYERS}, {STEPS} steps, CFG on, output_type='latent'; "
            "per steady request (the third), exact counts"
        ),
        "",
        (
            "| strategy | device ops | / resident | host waits | copies | H2D bytes | "
            "D2H bytes | peak device bytes | max abs diff | races |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['strategy']} | failed: {r['error']} |||||||||")
            continue
        lines.append(
            f"| {r['strategy']} | {r['device_ops']:,} | "
            f"{r['device_ops'] / res['device_ops']:.2f} | "
            f"{r['host_waits']:,} | {r['copies']:,} | {r['h2d_bytes']:,} | {r['d2h_bytes']:,} | "
            f"{r['peak_bytes']:,} | {r['max_abs_diff']:.1e} | {r['races']} |"
        )
    lines += [
        "",
        "| target (issues 18, 34) | device ops | host waits | copies |",
        "|---|---|---|---|",
    ]
    for t in result["targets"]:

        def cell(key: str, rule: str) -> str:
            met = "met" if t[f"{key}_met"] else "**not met**"
            return f"{t[key]:,} <= {t[key + '_max']:,} ({rule}): {met}"

        lines.append(
            f"| {t['target']} | {cell('device_ops', t['device_ops_rule'])} | "
            f"{cell('host_waits', t['host_waits_rule'])} | {cell('copies', t['copies_rule'])} |"
        )
    notes = []
    for r in rows:
        if "error" in r:
            continue
        extra = [
            f"forwards: {r['dit_forwards']} DiT + {r['text_encoder_forwards']} text encoder, "
            f"{r['transitions']} transitions"
        ]
        if "block_loads" in r:
            extra.append(
                f"{r['block_loads']} block loads ({r['block_loads_by_calls']} BlockStreamer._load "
                f"calls), {r['trunk_loads']} trunk loads, {r['component_evictions']} evictions"
            )
        elif "component_loads" in r:
            extra.append(
                f"{r['component_loads']} component loads, {r['component_evictions']} evictions"
            )
        if "engine" in r:
            e = r["engine"]
            extra.append(
                f"engine: weight H2D {e['h2d_bytes']:,} B, weight D2H {e['d2h_bytes']:,} B, "
                f"{e['fingerprints']} fingerprints, check read-backs {e['check_d2h_bytes']} B"
            )
            if e["disk_backed_bytes"]:
                extra.append(
                    f"disk tier: {e['disk_backed_bytes']:,} B on disk, {e['disk_read_bytes']:,} B "
                    f"read, staging ring {e['staging_bytes']:,} B: {e['staging_copies']} copies, "
                    f"{e['staging_waits']} buffer reuses"
                )
        calls = ", ".join(f"{k} {v}" for k, v in sorted(r["stream_event_calls"].items()))
        extra.append(
            f"host waits that are synchronize() calls: {r['synchronizes']}, stream/event calls: "
            f"{calls or 'none'}; stream waits {r['stream_waits']}, events {r['events']}"
        )
        if r["leaked_bytes"]:
            extra.append(f"{r['leaked_bytes']:,} device bytes left after it was freed")
        if r["note"]:
            extra.append(r["note"])
        notes.append(f"* {r['strategy']}: " + "; ".join(extra))
    lines += [""] + notes
    for r in rows:
        if "breakdown" not in r:
            continue
        lines += ["", f"Breakdown, {r['strategy']} (each op in the innermost engine function):", ""]
        lines += [
            (
                "| where | calls | device ops | host waits | copies | per call, with callees: "
                "ops / waits / copies |"
            ),
            "|---|---:|---:|---:|---:|---:|",
        ]
        engine = [0, 0, 0]
        free = []
        items = sorted(r["breakdown"].items(), key=lambda kv: (-kv[1][4], -kv[1][5], kv[0]))
        for name, (calls, ops, waits, copies, i_ops, i_waits, i_copies) in items:
            engine = [engine[0] + ops, engine[1] + waits, engine[2] + copies]
            if not (i_ops or i_waits or i_copies):
                free.append(f"{name} ({calls:,})")
                continue
            lines.append(
                f"| {name} | {calls:,} | {ops:,} | {waits:,} | {copies:,} | "
                f"{i_ops / calls:.1f} / {i_waits / calls:.2f} / {i_copies / calls:.1f} |"
            )
        lines.append(
            f"| pipeline (outside the engine) | | {r['device_ops'] - engine[0]:,} | "
            f"{r['host_waits'] - engine[1]:,} | {r['copies'] - engine[2]:,} | |"
        )
        if free:
            lines += ["", "Called, spending nothing: " + ", ".join(free) + "."]
    if not_wrapped:
        lines += ["", f"(not in this version, not attributed: {', '.join(not_wrapped)})"]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", metavar="PATH", help="also write the results as JSON ('-': stdout)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = fa.install()
    install_attribution()
    start = time.perf_counter()
    done = []
    for name, setup in setups(device):
        try:
            done.append(measure(name, setup))
        except Exception as exc:  # noqa: BLE001 - a failing strategy is a result
            error = f"{type(exc).__name__}: {exc}".split("\n")[0]
            print(f"  {name}: FAILED {error}", file=sys.stderr, flush=True)
            done.append(Strategy(name, row={"strategy": name, "error": error}))
            gc.collect()
    ref = done[0].out
    for st in done:
        if st.out is not None and ref is not None:
            st.row["max_abs_diff"] = float(np.abs(st.out - ref).max())
    rows = [st.row for st in done]
    result = {
        "rows": rows,
        "targets": targets({r["strategy"]: r for r in rows if "error" not in r}),
    }
    print(markdown(result))
    import diffusers

    stamp = datetime.date.today().isoformat()
    print(
        f"\n(total {time.perf_counter() - start:.0f} s; {stamp}; torch {torch.__version__}, "
        f"diffusers {diffusers.__version__})"
    )
    if args.json:
        payload = {
            "date": stamp,
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "kind": KIND,
            "num_layers": LAYERS,
            "steps": STEPS,
            **result,
        }
        text = json.dumps(payload, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    bad = [r["strategy"] for r in rows if "error" in r or r["max_abs_diff"] != 0 or r["races"]]
    if bad:
        print(f"failed, differs from all resident or raced: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
