"""``diffusion_offload_config="auto"``: the engine asks the planner which config to run.

``Omni(diffusion_offload_config="auto")`` (and ``--diffusion-offload-config auto`` on
``generate`` and ``serve``) plans the model it is loading for the device it runs on, at the
request shape it is given (``generate``: the command's size, frames and steps; ``Omni`` and
``serve``: ``plan_shape`` or the model's defaults), with the device's free memory as
``device_memory``, and runs the fastest candidate that fits
(:func:`~.plan.fastest_fitting`). It says which in one line. When nothing fits it raises a
one-line :class:`~diffusion_offload.models.fit.FitError` naming the smallest need.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..units import human_bytes
from .memory import DEVICE_KINDS
from .plan import DEFAULT_H2D_BANDWIDTH, HostInputs, PlanRow, choose, plan_model, resolve_request

__all__ = ["AutoChoice", "auto_config"]


@dataclass(frozen=True)
class AutoChoice:
    """What ``"auto"`` picked.

    Attributes:
        config: the offload config to run (None: no offload).
        budget: the ``device_memory_budget`` to run it with (bytes), or None.
        row: the chosen plan row.
        rows: every row of the plan.
        message: the one line said to the user.
    """

    config: Any
    budget: int | None
    row: PlanRow
    rows: tuple[PlanRow, ...]
    message: str


def _what(request: Any, device_kind: str) -> str:
    frames = f", {request.num_frames} frames" if request.num_frames else ""
    return f"{request.width}x{request.height}{frames}, {request.steps} steps on {device_kind}"


def auto_config(
    path: str | Path,
    *,
    device_kind: str,
    free_bytes: int,
    dtype: Any,
    variant: str | None = None,
    component_roles: Mapping[str, str] | None = None,
    shape: Mapping[str, int | None] | None = None,
    modes: Sequence[str] = ("module",),
    h2d_bandwidth: float = DEFAULT_H2D_BANDWIDTH,
    layer_blocks: Mapping[str, Sequence[str]] | None = None,
    budget: bool = True,
    host_memory_budget: int | None = None,
) -> AutoChoice:
    """Plan ``path`` and return the config of the fastest candidate that fits.

    Args:
        path: the pipeline folder the engine loads.
        device_kind: the device type (``cuda``, ``fakegpu``, ...); an unknown kind is
            planned as ``cuda``.
        free_bytes: device memory free for the model (bytes).
        dtype: the load dtype (a torch dtype).
        variant, component_roles: as given to ``Omni``.
        shape: ``height``, ``width``, ``num_frames``, ``num_inference_steps`` (None or
            missing: the model's defaults).
        modes: offload modes the engine can run; rows of other modes are not picked.
        budget: False when the caller fixed ``device_memory_budget`` itself: rows that set
            one are not picked.
        h2d_bandwidth: host-to-device bytes/s used to rank candidates.
        layer_blocks: block container overrides per component (layer mode).
        host_memory_budget: the backends' host-memory budget (bytes): each row's host
            columns follow the backends' tier rule under it, and a row whose RAM-only
            host copies exceed it does not fit (:mod:`.host`); None: no budget.

    Raises:
        FitError: no runnable candidate fits (one line: the smallest need).
        ModelError, ValueError: as :func:`~.plan.plan_offload`.
    """
    from ..core.config import parse_diffusion_offload_config
    from .model import load_plan_model

    kind = device_kind if device_kind in DEVICE_KINDS else "cuda"
    shape = dict(shape or {})
    pm = load_plan_model(path, variant=variant, dtype=dtype, component_roles=component_roles,
                         layer_blocks=layer_blocks)
    request = resolve_request(pm, shape.get("height"), shape.get("width"), shape.get("num_frames"),
                              shape.get("num_inference_steps"))
    rows = plan_model(pm, request, free_bytes, device_kind=kind, h2d_bandwidth=h2d_bandwidth,
                      host=HostInputs(host_memory_budget))
    runnable = [r for r in rows
                if (r.config.get("diffusion_offload_config") is None
                    or r.config["diffusion_offload_config"]["mode"] in modes)
                and (budget or "device_memory_budget" not in r.config)]
    what = _what(request, kind)
    row = choose(runnable, free_bytes, what)
    config = parse_diffusion_offload_config(row.config.get("diffusion_offload_config"))
    budget = row.config.get("device_memory_budget")
    with_budget = f", device_memory_budget={budget}" if budget is not None else ""
    message = (
        f"diffusion_offload_config=auto picked '{row.name}' "
        f"({config.to_json() if config is not None else 'no offload'}{with_budget}): predicted peak "
        f"{human_bytes(row.peak_bytes)} of {human_bytes(free_bytes)} free, "
        f"{human_bytes(row.h2d_bytes_per_request)} host->device per request, for {what}"
    )
    return AutoChoice(config, budget, row, tuple(rows), message)
