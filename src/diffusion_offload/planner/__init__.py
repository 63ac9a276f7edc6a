"""The offload planner: what fits, at what peak and what transfer cost, before loading a weight.

``plan_offload(model, device_memory=..., height=..., width=..., num_frames=..., steps=...)``
returns one :class:`PlanRow` per offload candidate; ``diffusion-offload plan MODEL`` prints
them; ``diffusion_offload_config="auto"`` (``Omni``, ``generate``, ``serve``) runs the
candidate :func:`~.plan.fastest_fitting` picks. See :mod:`.plan` for the residency rules,
:mod:`.memory` for the memory model per device kind, :mod:`.stages` for how activations are
measured and :mod:`.model` for where sizes come from.
"""

from __future__ import annotations

from ..lazy import lazy_exports

__all__ = [
    "DEFAULT_H2D_BANDWIDTH",
    "DEVICE_KINDS",
    "PlanRow",
    "fastest_fitting",
    "format_plan",
    "plan_offload",
    "shipped_models",
]

_LAZY = {
    "DEFAULT_H2D_BANDWIDTH": ".plan",
    "PlanRow": ".plan",
    "fastest_fitting": ".plan",
    "format_plan": ".plan",
    "plan_offload": ".plan",
    "DEVICE_KINDS": ".memory",
    "shipped_models": ".model",
}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__, globals())
