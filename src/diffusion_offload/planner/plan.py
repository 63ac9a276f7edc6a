"""``plan_offload``: what each offload candidate needs, before a single weight is loaded.

For one model and one request shape the planner

1. sizes every component from its safetensors headers (or a shipped weightless config),
   see :mod:`.model`;
2. replays one request on the meta device and measures the live activation bytes of each
   segment of it (a stretch during which one component runs), under the attention memory
   model of ``device_kind``, see :mod:`.stages` and :mod:`.memory`;
3. for every candidate, walks the request's segments with that candidate's residency rule
   and reports, per request: the most weight bytes resident at once (``resting_bytes``),
   the most weight plus activation bytes (``peak_bytes``), the host-to-device bytes
   (``h2d_bytes_per_request``, steady state: a request after the first) and their time
   at ``h2d_bandwidth`` (``transfer_seconds``).

Residency rules (SPEC sections 4 and 10):

* **all resident** (no offload): every component on the device (``pipeline.to``; on a
  PrivateUse1 device, the fake one and NPU, a Parameter shared by two modules is copied
  once per module, as PyTorch's ``_apply`` does there).
* **module** (``mode="module"``, strict: no budget): after ``enable`` the selected DiTs are
  on the host and everything else on the device. A DiT's hook evicts the selected encoders
  and every other selected DiT, then loads itself; an encoder's hook evicts the selected
  DiTs and loads all selected encoders (one group); the VAE's hook evicts the selected
  DiTs; unselected components never move. Evictions cost no transfer (unmodified
  weights); every load copies the component's bytes host-to-device.
* **layer** (``mode="layer"``, offered when ``LayerwiseOffloadBackend`` exists): the
  non-block parts of the selected components, the first ``resident_layers`` blocks of each
  selected DiT and a double buffer of the two largest blocks stay on the device, with the
  unselected components; every forward call of a selected component streams its other
  blocks host-to-device (prefetches the backend drops after a wrong guess, at most one
  block per change of component, are not counted).
* **layer with a memory budget** (``device_memory_budget`` in layer mode): the budget is
  ``device_memory`` minus the largest activation peak of a segment; beyond the trunks,
  the unselected components and the double buffer, the blocks
  ``core.policy.keep_blocks`` picks for the request's calls per component stay resident
  (the backend runs the same function on the calls it observed), so they stream no
  more.
* **module with a memory budget** (``device_memory_budget``, when ``Omni`` takes it): the
  budget is ``device_memory`` minus the largest activation peak of a segment; a stage
  evicts selected components, farthest next use first, only until its group fits the
  budget; the VAE keeps the DiTs beside it. The predicted peak takes the budget as full
  at every segment (prefetching may fill it).

Time: ``transfer_seconds = h2d_bytes_per_request / h2d_bandwidth``, as if no copy overlapped
compute (layer mode overlaps them, so its real cost is lower). Compute is the same for
every candidate, so the fastest candidate is the one that transfers least.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core.config import DiffusionOffloadConfig
from ..core.policy import BlockSpec, keep_blocks
from ..units import human_bytes
from .host import DEFAULT_DISK_BANDWIDTH, host_columns
from .memory import DEVICE_KINDS
from .model import ComponentSize, PlanModel, load_plan_model
from .stages import Request, StageReport, measure_request

__all__ = [
    "DEFAULT_H2D_BANDWIDTH",
    "HostInputs",
    "PlanRow",
    "choose",
    "fastest_fitting",
    "format_plan",
    "plan_model",
    "plan_offload",
    "predict_peak",
]

DEFAULT_H2D_BANDWIDTH = 25e9
"""Default host-to-device bandwidth (bytes/s): pinned copies over PCIe 4.0 x16 reach about
25 GB/s (PCIe 5.0 x16: about 50-55 GB/s)."""


_PRIVATEUSE1 = ("fakegpu", "npu")  # device kinds registered as PyTorch's PrivateUse1


@dataclass(frozen=True)
class PlanRow:
    """One offload candidate for one model and request shape.

    Attributes:
        name: a short label (``"all resident"``, ``"module dit+text_encoder"``,
            ``"layer dit+text_encoder k=4"``).
        config: the ``Omni`` keyword arguments that select it, e.g.
            ``{"diffusion_offload_config": {"mode": "module", "components": [...]}}``
            (``None`` config: no offload), plus ``"device_memory_budget": bytes`` for the
            budget candidate: ``Omni(model, **row.config)`` runs it.
        resting_bytes: the most weight bytes on the device at any moment of a request
            (bytes; what the resting-footprint fit check tests).
        peak_bytes: the most weight plus activation bytes on the device at any moment of
            a request (bytes).
        h2d_bytes_per_request: host-to-device weight bytes of one request, steady state
            (bytes).
        transfer_seconds: ``h2d_bytes_per_request`` at the planned bandwidth, plus
            ``disk_read_bytes_per_request`` at the disk bandwidth (seconds).
        fits: ``peak_bytes <= device_memory`` and ``host_fits``.
        pinned_bytes, pageable_bytes, disk_bytes, staging_bytes: where the host copies
            live under the host-memory budget (``host.HostColumns``; without a budget every
            host copy is pinned).
        disk_read_bytes_per_request: disk-backed bytes read per request (steady state).
        host_fits: what must live in RAM fits the host-memory budget.
    """

    name: str
    config: dict[str, Any]
    resting_bytes: int
    peak_bytes: int
    h2d_bytes_per_request: int
    transfer_seconds: float
    fits: bool
    pinned_bytes: int = 0
    pageable_bytes: int = 0
    disk_bytes: int = 0
    staging_bytes: int = 0
    disk_read_bytes_per_request: int = 0
    host_fits: bool = True


@dataclass(frozen=True)
class _Candidate:
    name: str
    config: dict[str, Any]
    kind: str  # "resident", "module", "budget", "layer"
    selected: frozenset[str] = frozenset()
    resident_layers: int = 0
    budget: int = 0  # "budget" and budgeted "layer" candidates: the device_memory_budget


def _selectable(pm: PlanModel, roles: Sequence[str]) -> frozenset[str]:
    return frozenset(n for n, c in pm.components.items() if c.role in roles)


def _module_candidates(pm: PlanModel) -> list[_Candidate]:
    has_dit = any(c.role == "dit" for c in pm.components.values())
    has_te = any(c.role == "text_encoder" for c in pm.components.values())
    selections = []
    if has_dit and has_te:
        selections.append(("dit", "text_encoder"))
    if has_dit:
        selections.append(("dit",))
    if has_te:
        selections.append(("text_encoder",))
    out = []
    for sel in selections:
        config = {"mode": "module", "components": list(sel)}
        out.append(_Candidate(f"module {'+'.join(sel)}", {"diffusion_offload_config": config},
                              "module", _selectable(pm, sel)))
    return out


def _budget_candidate(pm: PlanModel, report: StageReport, device_memory: int,
                      given: int | None = None) -> _Candidate | None:
    """Module mode (DiTs and text encoders) with ``device_memory_budget`` = ``given``, or
    the device memory minus the largest activation peak of a segment, so that weights
    (which the budget bounds) plus activations fit; at least what one stage needs
    resident."""
    comps = pm.components
    sel = _selectable(pm, ("dit", "text_encoder"))
    if not any(comps[n].role == "dit" for n in sel):
        return None
    fixed = pm.bytes_of(n for n in comps if n not in sel)
    encoders = {n for n in sel if comps[n].role != "dit"}
    groups = [pm.bytes_of(encoders)] + [comps[n].nbytes for n in sel if n not in encoders]
    least = fixed + max(groups)
    if given is None:
        given = device_memory - max((p for _, p in report.segments), default=0)
    budget = max(given, least)
    config = {"mode": "module", "components": ["dit", "text_encoder"]}
    return _Candidate("module dit+text_encoder + budget",
                      {"diffusion_offload_config": config, "device_memory_budget": budget},
                      "budget", frozenset(sel), budget=budget)


def _walk_budget(pm: PlanModel, report: StageReport, cand: _Candidate) -> _Walk:
    """The memory policy with a budget (``policy.MemoryPolicy``): a stage loads its group
    (all selected encoders together, or one DiT), first evicting selected components by
    farthest next use in the request's cyclic order until the budget holds; nothing else
    moves (the VAE keeps the DiTs beside it; prefetch moves the same bytes earlier).
    Transfers: the mean of two consecutive steady-state requests (with room for two of
    Wan2.2's three components the pattern alternates), and the loads per component (their
    mean). The peak assumes the budget full at every segment (prefetch may fill it)."""
    comps = pm.components
    sel = cand.selected
    encoders = {n for n in sel if comps[n].role != "dit"}
    budget = cand.budget
    order: list[frozenset[str]] = []
    for name, _ in report.segments:
        group = frozenset(encoders if name in encoders else {name})
        if not order or order[-1] != group:
            order.append(group)
    resident = {n for n in comps if comps[n].role != "dit" or n not in sel}
    total = pm.bytes_of(comps)
    resting = 0
    moved: list[int] = []
    counts: list[dict[str, int]] = []
    for _request in range(5):  # steady state: the policy may alternate between two patterns
        h2d = 0
        count: dict[str, int] = {}
        for pos, group in enumerate(order):
            missing = (group & sel) - resident
            need = pm.bytes_of(missing)
            pool = [n for n in resident if n in sel and n not in group]

            def distance(name: str, pos: int = pos) -> int:
                for d in range(1, len(order) + 1):
                    if name in order[(pos + d) % len(order)]:
                        return d
                return len(order) + 1

            for victim in sorted(pool, key=distance, reverse=True):
                if pm.bytes_of(resident) + need <= budget:
                    break
                resident.discard(victim)
            resident |= missing
            h2d += need
            for name in missing:
                count[name] = count.get(name, 0) + 1
            resting = max(resting, pm.bytes_of(resident))
        moved.append(h2d)
        counts.append(count)
    h2d = (moved[-1] + moved[-2]) // 2
    loads = {n: (counts[-1].get(n, 0) + counts[-2].get(n, 0)) / 2 for n in sel}
    full = min(budget, total)
    peak = max(full + act for _, act in report.segments) if report.segments else full
    return resting, peak, h2d, loads


def _layer_selection(pm: PlanModel) -> tuple[str, ...]:
    dits = [c for c in pm.components.values() if c.role == "dit"]
    if not dits or any(not c.blocks for c in dits):
        return ()
    tes = [c for c in pm.components.values() if c.role == "text_encoder"]
    return ("dit", "text_encoder") if tes and all(c.blocks for c in tes) else ("dit",)


def _layer_candidate(pm: PlanModel, sel: tuple[str, ...], k: int) -> _Candidate:
    config: dict[str, Any] = {"mode": "layer", "components": list(sel)}
    if k:
        config["layer_options"] = {"dit": {"resident_layers": k}}
    return _Candidate(f"layer {'+'.join(sel)} k={k}", {"diffusion_offload_config": config},
                      "layer", _selectable(pm, sel), k)


def _layer_budget_candidate(pm: PlanModel, report: StageReport, sel: tuple[str, ...],
                            device_memory: int, budget: int | None) -> _Candidate:
    """Layer mode with ``device_memory_budget`` = ``budget``, or the device memory minus the
    largest activation peak of a segment; at least the trunks, the unselected components
    and the two largest blocks."""
    fixed, blocks = _layer_parts(pm, frozenset(_selectable(pm, sel)), 0)
    least = fixed + sum(sorted((n for _, _, n in blocks), reverse=True)[:2])
    if budget is None:
        budget = device_memory - max((p for _, p in report.segments), default=0)
    budget = max(budget, least)
    config = {"mode": "layer", "components": list(sel)}
    return _Candidate(f"layer {'+'.join(sel)} + budget",
                      {"diffusion_offload_config": config, "device_memory_budget": budget},
                      "layer", _selectable(pm, sel), budget=budget)


def _layer_parts(pm: PlanModel, sel: frozenset[str], k: int) -> tuple[int, list[BlockSpec]]:
    """``(bytes that always stay on the device, the streamed blocks)`` of layer mode with
    ``resident_layers`` k: trunks, resident layers and unselected components; blocks as
    ``(component, position, bytes)``."""
    fixed = 0
    blocks: list[BlockSpec] = []
    for name, c in pm.components.items():
        if name not in sel:
            fixed += c.nbytes
            continue
        keep = k if c.role == "dit" else 0
        fixed += c.nbytes - sum(c.blocks[keep:])
        blocks += [(name, i, n) for i, n in enumerate(c.blocks[keep:])]
    return fixed, blocks


_Walk = tuple[int, int, int, dict[str, float]]


def _walk(pm: PlanModel, report: StageReport, cand: _Candidate, device_kind: str) -> _Walk:
    """``(resting, peak, h2d per request, loads)`` of ``cand`` over the request's segments
    (bytes; loads: per selected component, how often a request loads it, or, layer mode,
    calls it)."""
    comps = pm.components
    if cand.kind == "resident":
        weights = pm.bytes_of(comps)
        if device_kind in _PRIVATEUSE1:  # ``pipeline.to()`` unties shared Parameters there
            weights += sum(c.tied_extra for c in comps.values())
        return weights, weights + max((p for _, p in report.segments), default=0), 0, {}
    if cand.kind == "layer":
        return _walk_layer(pm, report, cand)
    if cand.kind == "budget":
        return _walk_budget(pm, report, cand)
    sel = cand.selected
    sel_dits = {n for n in sel if comps[n].role == "dit"}
    sel_encoders = sel - sel_dits
    resident = {n for n in comps if n not in sel_dits}  # after enable
    resting = peak = h2d = 0
    loads: dict[str, float] = {}
    for request in (0, 1):
        moved = 0
        loads = {}
        for name, act in report.segments:
            role = comps[name].role if name in comps else "resident"
            if role == "dit":
                resident -= sel_encoders | (sel_dits - {name})
            elif role in ("text_encoder", "encoder", "vae"):
                resident -= sel_dits
            group = sel_encoders if name in sel_encoders else {name}  # encoders load together
            for member in sorted(group & sel - resident):
                resident.add(member)
                moved += comps[member].nbytes
                loads[member] = loads.get(member, 0) + 1
            weights = pm.bytes_of(resident)
            resting = max(resting, weights)
            peak = max(peak, weights + act)
        h2d = moved  # the second request: steady state
    return resting, peak, h2d, loads


def _walk_layer(pm: PlanModel, report: StageReport, cand: _Candidate) -> _Walk:
    """Layer mode: the fixed bytes, the kept blocks (with a budget) and the two largest
    streamed blocks at rest; every call streams its component's other blocks."""
    fixed, blocks = _layer_parts(pm, cand.selected, cand.resident_layers)
    kept = set(keep_blocks(blocks, report.calls, cand.budget - fixed)) if cand.budget else set()
    streamed = [b for i, b in enumerate(blocks) if i not in kept]
    weights = fixed + sum(blocks[i][2] for i in kept)
    weights += sum(sorted((n for _, _, n in streamed), reverse=True)[:2])
    h2d = sum(report.calls.get(name, 0) * n for name, _, n in streamed)
    peak = weights + max((p for _, p in report.segments), default=0)
    return weights, peak, h2d, {n: float(c) for n, c in report.calls.items()}


def _kept(pm: PlanModel, report: StageReport, cand: _Candidate) -> list[tuple[str, int]]:
    """Layer mode with a device budget: ``(component, position)`` of the streamed blocks
    kept resident."""
    if not cand.budget:
        return []
    fixed, blocks = _layer_parts(pm, cand.selected, cand.resident_layers)
    return [blocks[i][:2] for i in keep_blocks(blocks, report.calls, cand.budget - fixed)]


@dataclass(frozen=True)
class HostInputs:
    """What the host side of a plan is planned with.

    Attributes:
        budget: the host-memory budget in bytes (None: no budget).
        disk_bandwidth: disk read bytes/s (``host.DEFAULT_DISK_BANDWIDTH``).
        max_pinned_bytes: the backend's pinning cap (None: none).
    """

    budget: int | None = None
    disk_bandwidth: float = DEFAULT_DISK_BANDWIDTH
    max_pinned_bytes: int | None = None


def _row(pm: PlanModel, report: StageReport, cand: _Candidate, device_memory: int,
         bandwidth: float, device_kind: str, host: HostInputs = HostInputs()) -> PlanRow:
    resting, peak, h2d, loads = _walk(pm, report, cand, device_kind)
    kind = "module" if cand.kind == "budget" else cand.kind
    kept = _kept(pm, report, cand) if kind == "layer" else []
    cols = host_columns(pm, kind, cand.selected, host.budget, loads, cand.resident_layers, kept,
                        host.max_pinned_bytes)
    seconds = h2d / bandwidth + cols.disk_read_bytes / host.disk_bandwidth
    return PlanRow(cand.name, cand.config, resting, peak, h2d, seconds,
                   peak <= device_memory and cols.fits, cols.pinned_bytes, cols.pageable_bytes,
                   cols.disk_bytes, cols.staging_bytes, cols.disk_read_bytes, cols.fits)


def _layer_rows(pm: PlanModel, report: StageReport, device_memory: int, bandwidth: float,
                kind: str, budget: int | None = None, host: HostInputs = HostInputs()) -> list[PlanRow]:
    sel = _layer_selection(pm)
    if not sel:
        return []
    budgeted = _layer_budget_candidate(pm, report, sel, device_memory, budget)
    most = min(len(c.blocks) for c in pm.components.values() if c.role == "dit")
    rows = [_row(pm, report, _layer_candidate(pm, sel, 0), device_memory, bandwidth, kind, host)]
    best = None
    for k in range(1, most + 1):
        row = _row(pm, report, _layer_candidate(pm, sel, k), device_memory, bandwidth, kind, host)
        if not row.fits:
            break
        best = row
    if best is not None:
        rows.append(best)
    rows.append(_row(pm, report, budgeted, device_memory, bandwidth, kind, host))
    return rows


def predict_peak(
    pm: PlanModel,
    request: Request,
    config: DiffusionOffloadConfig | None,
    device_memory_budget: int | None = None,
    *,
    device_kind: str = "cuda",
    report: StageReport | None = None,
) -> int:
    """The predicted device peak (weights plus activations, bytes) of one request of shape
    ``request`` under one engine config (None: all resident), with the engine's
    ``device_memory_budget`` (bytes, or None: strict). The same walk as the rows of
    :func:`plan_model` (``report``: a :func:`~.stages.measure_request` of ``request``
    already made, else one is made); the tiny pipelines hold it within
    ``[measured, 1.10 x measured]`` (``tests/test_planner_tiny.py``).

    Raises:
        ValueError: a config the planner has no rule for (the legacy switch, layer mode on
            components without blocks), or no activation model for this pipeline (from
            ``measure_request``).
    """
    if config is not None and not config.explicit:  # it also moves image encoders: no rule
        raise ValueError("the legacy enable_cpu_offload switch: no planner rule")
    if config is None:
        cand = _Candidate("all resident", {}, "resident")
    elif config.mode == "module":
        sel = _selectable(pm, config.components)
        # the budget only holds DiTs back: strict without a selected DiT
        budgeted = device_memory_budget is not None and any(pm.components[n].role == "dit" for n in sel)
        cand = _Candidate("engine", {}, "budget" if budgeted else "module", sel, budget=device_memory_budget or 0)
    else:  # layer (the two modes a config takes)
        sel = _selectable(pm, config.components)
        if any(not pm.components[n].blocks for n in sel):
            raise ValueError("layer mode on components without blocks: no planner rule")
        options = dict(config.layer_options).get("dit")
        k = (options.resident_layers or 0) if options is not None else 0
        cand = _Candidate("engine", {}, "layer", sel, k, budget=device_memory_budget or 0)
    if report is None:
        report = measure_request(pm, request, device_kind)
    return _walk(pm, report, cand, device_kind)[1]


def fastest_fitting(rows: Sequence[PlanRow]) -> PlanRow | None:
    """The row ``auto`` picks: the least transfer time among rows that fit, ties broken by
    the smaller peak; None when none fits."""
    fitting = [r for r in rows if r.fits]
    return min(fitting, key=lambda r: (r.transfer_seconds, r.peak_bytes)) if fitting else None


def default_device_memory(device_kind: str) -> int:
    """Total memory of this machine's ``device_kind`` device (bytes; the fake device: its
    capacity).

    Raises:
        ValueError: no such device here (the message asks for ``device_memory``).
    """
    import torch

    module = getattr(torch, device_kind, None)
    if device_kind == "fakegpu":
        from ..testing import fake_accelerator

        if fake_accelerator.is_installed() and fake_accelerator.stats()["capacity"] >= 0:
            return fake_accelerator.stats()["capacity"]
    elif module is not None and getattr(module, "is_available", lambda: False)():
        return int(module.mem_get_info()[1])
    raise ValueError(
        f"device_memory is required: there is no {device_kind} device on this machine to read it "
        "from (give bytes, e.g. device_memory=24 * 2**30, or --device-memory 24GiB)"
    )


def _check_positive(name: str, value: Any, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: an int >= 1")


def plan_model(
    pm: PlanModel,
    request: Request,
    device_memory: int,
    *,
    device_kind: str = "cuda",
    h2d_bandwidth: float = DEFAULT_H2D_BANDWIDTH,
    device_memory_budget: int | None = None,
    host: HostInputs = HostInputs(),
) -> list[PlanRow]:
    """The rows of an already loaded :class:`~.model.PlanModel` (see :func:`plan_offload`).

    ``device_memory_budget``: the budget of the two budget rows (module and layer mode,
    bytes; raised to the smallest workable one); None: ``device_memory`` minus the
    largest activation peak. ``host``: the host-memory budget and disk bandwidth the host
    columns are planned with (:mod:`.host`)."""
    report = measure_request(pm, request, device_kind)
    everything = _Candidate("all resident", {"diffusion_offload_config": None}, "resident")
    rows = [_row(pm, report, everything, device_memory, h2d_bandwidth, device_kind, host)]
    candidates = _module_candidates(pm)
    budgeted = _budget_candidate(pm, report, device_memory, device_memory_budget)
    candidates += [budgeted] if budgeted is not None else []
    for cand in candidates:
        rows.append(_row(pm, report, cand, device_memory, h2d_bandwidth, device_kind, host))
    rows += _layer_rows(pm, report, device_memory, h2d_bandwidth, device_kind, device_memory_budget,
                        host)
    return rows


def resolve_request(pm: PlanModel, height: int | None, width: int | None, num_frames: int | None,
                    steps: int | None, cfg: bool | None = None,
                    max_sequence_length: int | None = None,
                    names: Mapping[str, str] | None = None) -> Request:
    """The request shape, omitted fields taking the model's defaults (as ``generate``).

    Args:
        names: how to name ``height``/``width``/``num_frames`` in errors (``"--height"``).

    Raises:
        ValueError: a size the model does not take (named, with what is allowed).
    """
    import inspect

    import diffusers

    from ..models.files import ModelInfo
    from ..models.rules import model_rules

    cls = getattr(diffusers, pm.pipeline_class, None)
    is_video = cls is not None and "num_frames" in inspect.signature(cls.__call__).parameters
    info = ModelInfo(pm.path, pm.pipeline_class, {}, {}, is_video)
    rules = model_rules(info)
    for name, value in (("height", height), ("width", width), ("num_frames", num_frames),
                        ("steps", steps), ("max_sequence_length", max_sequence_length)):
        _check_positive(name, value)
    rules.check({"height": height, "width": width, "num_frames": num_frames},
                names or {"height": "height", "width": "width", "num_frames": "num_frames"})
    values = rules.resolve({"height": height, "width": width, "num_frames": num_frames,
                            "num_inference_steps": steps})
    missing = [k for k in ("height", "width", "num_inference_steps") if values.get(k) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)}: the model has no default; give a value")
    return Request(int(values["height"]), int(values["width"]),
                   int(values["num_frames"]) if is_video and values.get("num_frames") else None,
                   int(values["num_inference_steps"]), cfg, max_sequence_length)


def plan_offload(
    model: str | os.PathLike,
    device_memory: int | None = None,
    *,
    height: int | None = None,
    width: int | None = None,
    num_frames: int | None = None,
    steps: int | None = None,
    device_kind: str = "cuda",
    h2d_bandwidth: float = DEFAULT_H2D_BANDWIDTH,
    dtype: str | None = "auto",
    variant: str | None = None,
    component_roles: Mapping[str, str] | None = None,
    cfg: bool | None = None,
    max_sequence_length: int | None = None,
    weights_dtype: str | Mapping[str, str] | None = None,
    host_memory_budget: int | None = None,
    disk_bandwidth: float = DEFAULT_DISK_BANDWIDTH,
) -> list[PlanRow]:
    """Predict, for every offload candidate, resting and peak device bytes and transfer cost.

    No weight is read: sizes come from safetensors headers (or a shipped weightless config
    for the hub ids of :func:`~.model.shipped_models`), activations from one request
    replayed on the meta device.

    Args:
        model: a diffusers pipeline folder or hub id (local cache or shipped config; never
            downloaded).
        device_memory: bytes the device may allocate; None reads the total memory of the
            ``device_kind`` device of this machine.
        height, width: output size in pixels (None: the model's default).
        num_frames: video frames (None: the model's default; ignored for image models).
        steps: denoising steps (None: the model's default).
        device_kind: one of ``cuda``, ``xpu``, ``npu``, ``mps``, ``fakegpu``, ``cpu``: picks
            the attention memory model (see :mod:`.memory`).
        h2d_bandwidth: host-to-device bandwidth in bytes/s (default 25e9).
        dtype: load dtype, as ``Omni(dtype=...)`` (``"auto"``: the checkpoint's).
        variant: weight variant, as ``Omni(variant=...)``.
        component_roles: role overrides, as ``Omni(component_roles=...)``.
        cfg: classifier-free guidance on/off (None: see :class:`~.stages.Request`).
        max_sequence_length: text tokens (None: the pipeline's default).
        weights_dtype: formats the weights are quantized or cast to at load
            (``"fp8"``, ``"dit=fp8,text_encoder=bf16"``: :mod:`.quant`).
        host_memory_budget: the backends' ``host_memory_budget`` in bytes: the host
            columns follow the backends' tier rule under it (:mod:`.host`); None: every
            host copy pinned, nothing on disk.
        disk_bandwidth: disk read bytes/s, for the disk reads' seconds (default 3e9).

    Returns:
        One :class:`PlanRow` per candidate: all resident, module mode for each selection
        (``dit+text_encoder``, ``dit``, ``text_encoder``), module mode with a
        ``device_memory_budget`` (when ``Omni`` takes one), and, when layer mode exists,
        layer mode with 0 resident layers, with the most resident layers that fit and
        with a ``device_memory_budget``.

    Raises:
        ModelError: the model cannot be found or read.
        ValueError: a bad device kind, size, bandwidth, device memory or dtype, or a
            pipeline without an activation model.
    """
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind={device_kind!r} is not allowed; allowed: {list(DEVICE_KINDS)}")
    if isinstance(h2d_bandwidth, bool) or not isinstance(h2d_bandwidth, (int, float)) or not h2d_bandwidth > 0:
        raise ValueError(f"h2d_bandwidth={h2d_bandwidth!r} is not allowed; allowed: bytes/s > 0")
    if device_memory is None:
        device_memory = default_device_memory(device_kind)
    if isinstance(device_memory, bool) or not isinstance(device_memory, int) or device_memory < 0:
        raise ValueError(f"device_memory={device_memory!r} is not allowed; allowed: an int >= 0 (bytes)")
    pm = load_plan_model(model, variant=variant, dtype=dtype, component_roles=component_roles,
                         weights_dtype=weights_dtype)
    request = resolve_request(pm, height, width, num_frames, steps, cfg, max_sequence_length)
    for name, value in (("host_memory_budget", host_memory_budget),):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}={value!r} is not allowed; allowed: an int >= 0 (bytes) or None")
    if isinstance(disk_bandwidth, bool) or not isinstance(disk_bandwidth, (int, float)) or not disk_bandwidth > 0:
        raise ValueError(f"disk_bandwidth={disk_bandwidth!r} is not allowed; allowed: bytes/s > 0")
    return plan_model(pm, request, device_memory, device_kind=device_kind, h2d_bandwidth=h2d_bandwidth,
                      host=HostInputs(host_memory_budget, float(disk_bandwidth)))


def choose(rows: Sequence[PlanRow], device_memory: int, what: str) -> PlanRow:
    """The fastest fitting row, or a one-line ``FitError`` naming the smallest need.

    Args:
        rows: the plan.
        device_memory: the bytes planned for (for the message).
        what: the request and device in words (for the message).

    Raises:
        FitError: no row fits.
    """
    best = fastest_fitting(rows)
    if best is not None:
        return best
    from ..models.fit import FitError

    smallest = min(rows, key=lambda r: r.peak_bytes)
    host = [r.name for r in rows if not r.host_fits]
    raise FitError(
        f"diffusion_offload_config='auto': no candidate fits in {human_bytes(device_memory)} "
        f"({device_memory} bytes) for {what}; the smallest need is '{smallest.name}' with a peak of "
        f"{human_bytes(smallest.peak_bytes)} ({smallest.peak_bytes} bytes)"
        + (f"; the host-memory budget cannot hold the RAM-only host copies of {host}" if host else "")
    )


def format_plan(rows: Sequence[PlanRow], *, title: str = "") -> str:
    """The rows as a text table in binary units; the row ``auto`` picks is marked ``*``."""
    best = fastest_fitting(rows)
    header = ("", "candidate", "resting", "peak", "H2D/request", "pinned", "pageable", "disk",
              "disk/request", "transfer", "fits")
    table = [header]
    for r in rows:
        table.append((
            "*" if r is best else "",
            r.name,
            human_bytes(r.resting_bytes),
            human_bytes(r.peak_bytes),
            human_bytes(r.h2d_bytes_per_request),
            human_bytes(r.pinned_bytes + r.staging_bytes),
            human_bytes(r.pageable_bytes),
            human_bytes(r.disk_bytes),
            human_bytes(r.disk_read_bytes_per_request),
            f"{r.transfer_seconds:.2f} s",
            "yes" if r.fits else ("no (host)" if not r.host_fits else "no"),
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = [title] if title else []
    for i, row in enumerate(table):
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [c.rjust(w) for c, w in zip(row[2:], widths[2:])]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("* fastest candidate that fits (what --diffusion-offload-config auto picks)"
                 if best is not None else "no candidate fits")
    return "\n".join(lines)


def describe_components(pm: PlanModel) -> list[ComponentSize]:
    """The components, largest first (for the table's preamble)."""
    return sorted(pm.components.values(), key=lambda c: -c.nbytes)


def describe_plan(pm: PlanModel, request: Request, device_memory: int, device_kind: str,
                  bandwidth: float) -> str:
    """The lines printed above the table: model, request, memory model, components."""
    from .memory import describe_memory_model

    frames = f", {request.num_frames} frames" if request.num_frames else ""
    source = "shipped weightless config" if pm.weightless else str(pm.path)
    lines = [
        f"model: {pm.model} ({pm.pipeline_class}, {str(pm.dtype).removeprefix('torch.')}; {source})",
        f"request: {request.width}x{request.height}{frames}, {request.steps} steps",
        f"device: {human_bytes(device_memory)} ({device_memory} bytes), {device_kind}: "
        f"{describe_memory_model(device_kind)}",
        f"host->device: {bandwidth / 1e9:g} GB/s",
        "components: " + ", ".join(
            f"{c.name} {human_bytes(c.nbytes)} ({c.role}, {c.params / 1e9:.2f}e9 params"
            + (f", {c.weights_format}" if c.weights_format else "") + ")"
            for c in describe_components(pm)),
        "",
    ]
    return "\n".join(lines)


def rows_json(pm: PlanModel, request: Request, rows: Sequence[PlanRow], device_memory: int,
              device_kind: str, bandwidth: float) -> str:
    """The plan as JSON: the inputs, the components and the rows (bytes, seconds)."""
    import json
    from dataclasses import asdict

    best = fastest_fitting(rows)
    return json.dumps({
        "model": pm.model,
        "pipeline_class": pm.pipeline_class,
        "dtype": str(pm.dtype).removeprefix("torch."),
        "request": asdict(request),
        "device_memory": device_memory,
        "device_kind": device_kind,
        "h2d_bandwidth": bandwidth,
        "components": {c.name: {"role": c.role, "bytes": c.nbytes, "params": c.params,
                                "blocks": len(c.blocks), "source": c.source,
                                "weights_format": c.weights_format}
                       for c in pm.components.values()},
        "rows": [asdict(r) for r in rows],
        "auto": best.name if best is not None else None,
    }, indent=2)
