"""``diffusion_offload.config``: the offload configuration, at its path from before the
offload core became ``diffusion_offload.core`` (kept so that code written against it keeps
importing). Defined in ``diffusion_offload.core.config``; the same objects."""

from __future__ import annotations

from .core.config import (
    COMPONENTS,
    MODES,
    WEIGHT_TRANSFERS,
    DiffusionOffloadConfig,
    LayerOptions,
    parse_diffusion_offload_config,
)

__all__ = [
    "COMPONENTS",
    "MODES",
    "WEIGHT_TRANSFERS",
    "DiffusionOffloadConfig",
    "LayerOptions",
    "parse_diffusion_offload_config",
]
