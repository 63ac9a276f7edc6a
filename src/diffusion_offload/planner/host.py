"""Host memory of each offload candidate (issue 20): pinned, pageable and disk bytes, and
disk bytes read per request, under a host-memory budget.

The tier rule is the backends' own (``core.tiers.split_tiers``): the planner only gives it
what the backend would see after ``Omni`` loads the model, in the backend's order:

* **which tensors get host copies**: module mode, every tensor of the selected components
  (``named_tensors`` order of the meta-built component, components in
  ``model_index.json`` order); layer mode, the tensors of each streamed block (the first
  ``resident_layers`` blocks of a DiT, and the trunks, stay on the device), a staging
  unit per block (``core.tiers.stage_unit``); all resident, none;
* **which are file-backed**: a tensor stored in the component's safetensors files under
  its name, at the load dtype (``Omni`` loads them as private memory maps); a weightless
  config's floating tensors count as file-backed (its checkpoint is loaded that way).
  Non-persistent buffers, tensors cast at load (another stored dtype) and weights
  quantized at load (``weights_format``) live in RAM.

Disk bytes per request: each load of a component (module mode) or each streamed call of
a block (layer mode) reads its disk-backed bytes once, through the staging ring.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..core.tiers import HostBudgetError, TierPlan, check_bytes, split_tiers, stage_unit
from ..models.files import safetensors_tensors
from .model import PlanModel, discover_block_modules

__all__ = ["DEFAULT_DISK_BANDWIDTH", "HostColumns", "component_sizes", "host_columns"]

DEFAULT_DISK_BANDWIDTH = 3e9
"""Default disk read bandwidth (bytes/s): a PCIe 3.0 x4 NVMe SSD reads about 3 GB/s."""

_STORED = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class HostColumns:
    """A candidate's host memory under a budget (bytes).

    Attributes:
        pinned_bytes: host copies in pinned RAM.
        pageable_bytes: host copies in pageable RAM (past ``max_pinned_bytes``).
        disk_bytes: host copies left on disk (file-backed).
        staging_bytes: the pinned staging ring (0 without a disk tier).
        disk_read_bytes: disk-backed bytes read per request (steady state).
        fits: the host copies that must live in RAM fit the budget (else ``enable``
            raises ``HostBudgetError``).
    """

    pinned_bytes: int = 0
    pageable_bytes: int = 0
    disk_bytes: int = 0
    staging_bytes: int = 0
    disk_read_bytes: int = 0
    fits: bool = True


def component_sizes(pm: PlanModel, name: str) -> list[tuple[str, int, bool]]:
    """``(name, bytes, file-backed)`` of every distinct tensor of component ``name``, in
    the backend's order (``named_tensors`` of the meta-built component; computed once)."""
    cached = pm.host_sizes.get(name)
    if cached is not None:
        return cached
    from ..core.residency import named_tensors

    comp = pm.components[name]
    top = pm.modules[name]
    stored = {k: v[0] for k, v in safetensors_tensors(pm.files[name]).items()} if pm.files.get(name) else None
    persistent = set(top.state_dict(keep_vars=True))
    out = []
    for key, t in named_tensors(top):
        nbytes = t.numel() * t.element_size()
        if comp.weights_format is not None or key not in persistent:
            backed = False
        elif stored is None:
            backed = pm.weightless and t.is_floating_point()
        else:
            backed = _STORED.get(stored.get(key, "")) == t.dtype
        out.append((key, nbytes, backed))
    pm.host_sizes[name] = out
    return out


def _block_sizes(pm: PlanModel, name: str, keep: int) -> list[list[tuple[int, bool]]]:
    """The sizes (as ``split_tiers`` takes) of each streamed block of ``name`` past the
    first ``keep``, in order."""
    top = pm.modules[name]
    prefixes = {id(m): n for n, m in top.named_modules()}
    sizes = component_sizes(pm, name)
    out = []
    for block in discover_block_modules(top)[keep:]:
        prefix = prefixes[id(block)] + "."
        out.append([(n, b) for key, n, b in sizes if key.startswith(prefix)])
    return out


def _split(sizes: list[tuple[int, bool]], budget: int | None, unit: int, overhead: int) -> TierPlan | None:
    """``split_tiers``, or None when the RAM-only host copies exceed the budget."""
    if budget is None:
        total = sum(n for n, _ in sizes)
        return TierPlan(1 << 62, total, 0, 0, 0)
    try:
        return split_tiers(sizes, budget, unit, overhead)
    except HostBudgetError:
        return None


def host_columns(
    pm: PlanModel,
    kind: str,
    selected: frozenset[str],
    budget: int | None,
    loads: Mapping[str, float],
    resident_layers: int = 0,
    kept: Sequence[tuple[str, int]] = (),
    max_pinned_bytes: int | None = None,
) -> HostColumns:
    """The host columns of one candidate.

    Args:
        pm: the planned model.
        kind: ``"resident"``, ``"module"`` (with or without a device budget) or ``"layer"``.
        selected: the selected components.
        budget: the host-memory budget in bytes (None: no budget, every host copy pinned).
        loads: module mode: loads per request of each component; layer mode: streamed
            calls per request of each component.
        resident_layers: layer mode's resident DiT blocks.
        kept: layer mode with a device budget: ``(component, position)`` of the streamed
            blocks kept resident (they read no disk).
        max_pinned_bytes: the backend's pinning cap (None: none).
    """
    if kind == "resident" or not selected:
        return HostColumns()
    groups: list[tuple[tuple[str, int], list[tuple[int, bool]]]] = []  # (component, block) -> sizes
    for name in pm.components:
        if name not in selected:
            continue
        if kind == "layer":
            keep = resident_layers if pm.components[name].role == "dit" else 0
            groups += [((name, pos), g) for pos, g in enumerate(_block_sizes(pm, name, keep))]
        else:
            groups.append(((name, -1), [(n, b) for _, n, b in component_sizes(pm, name)]))
    sizes = [s for _, g in groups for s in g]
    unit = stage_unit(g for _, g in groups) if kind == "layer" else 0
    plan = _split(sizes, budget, unit, check_bytes([n for n, _ in g] for _, g in groups))
    if plan is None:
        return HostColumns(fits=False)
    pinned, pageable = plan.pinned_split(max_pinned_bytes)
    skip = set(kept)
    read = 0.0
    index = 0
    for key, g in groups:
        disk = sum(n for i, (n, _) in enumerate(g, start=index) if i in plan.disk_ids)
        index += len(g)
        if key not in skip:
            read += disk * loads.get(key[0], 0)
    return HostColumns(pinned, pageable, plan.disk_bytes, plan.staging_bytes, int(read))
