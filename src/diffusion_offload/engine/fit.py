"""The fit check: will a config's resting footprint fit the device, before any weight loads?

At rest under model-level offload the device holds the residents (VAEs, unselected
components) plus the largest group that takes its turn: one selected DiT, or all
selected encoders together (text encoders of one pipeline run back to back and do not
evict each other). Host memory holds every selected component (pinned when pinning is
on and supported). Activations come on top of this; the check is for weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..config import DiffusionOffloadConfig, parse_diffusion_offload_config
from ..discovery import diffusers_role
from .model_files import ModelInfo

__all__ = ["FitError", "Footprint", "check_fit", "footprint"]


class FitError(ValueError):
    """The device cannot hold what the chosen config keeps on it."""


@dataclass(frozen=True)
class Footprint:
    """Bytes a config needs.

    Attributes:
        device_bytes: residents + the largest group (weights only).
        host_bytes: bytes of the components that move to the host.
        pinned_bytes: of those, bytes pinned (0 when pinning is off or unsupported).
        largest_group: names of the components in the largest group.
    """

    device_bytes: int
    host_bytes: int
    pinned_bytes: int
    largest_group: tuple[str, ...]


def _roles(info: ModelInfo, component_roles: Mapping[str, str] | None) -> dict[str, str]:
    roles = {}
    for name in info.numels:
        role = (component_roles or {}).get(name) or diffusers_role(name) or "resident"
        roles[name] = role
    return roles


def footprint(
    info: ModelInfo,
    config: DiffusionOffloadConfig | None,
    dtype_bytes: int | None,
    pin_supported: bool,
    component_roles: Mapping[str, str] | None = None,
) -> Footprint:
    """Compute the resting device, host and pinned bytes of ``config`` for ``info``.

    ``config=None`` means no offload: everything on the device. ``dtype_bytes`` is the
    element size the floating weights are loaded in (None: as stored).
    """
    sizes = {n: info.component_bytes(n, dtype_bytes) for n in info.numels}
    roles = _roles(info, component_roles)
    if config is None:
        return Footprint(sum(sizes.values()), 0, 0, tuple(sizes))
    moving = {n for n, r in roles.items() if config.offloads_role(r)}
    resident = sum(s for n, s in sizes.items() if n not in moving)
    groups = [(n,) for n in moving if roles[n] == "dit"]
    encoders = tuple(n for n in moving if roles[n] != "dit")
    if encoders:
        groups.append(encoders)
    largest: tuple[str, ...] = max(groups, key=lambda g: sum(sizes[n] for n in g), default=())
    host = sum(sizes[n] for n in moving)
    pinned = host if (config.pin_memory and pin_supported) else 0
    return Footprint(resident + sum(sizes[n] for n in largest), host, pinned, tuple(sorted(largest)))


_CANDIDATES = (
    {"mode": "module", "components": ["text_encoder"]},
    {"mode": "module", "components": ["dit"]},
    {"mode": "module", "components": ["dit", "text_encoder"]},
)


def check_fit(
    info: ModelInfo,
    config: DiffusionOffloadConfig | None,
    dtype_bytes: int | None,
    free_bytes: int | None,
    pin_supported: bool,
    component_roles: Mapping[str, str] | None = None,
) -> Footprint:
    """Return the footprint, or raise ``FitError`` if it exceeds ``free_bytes``.

    The error gives the bytes needed and the bytes free, and suggests the first config
    (fewest components moved) that would fit, or says that none does.

    Raises:
        FitError: the resting device bytes exceed ``free_bytes``.
    """
    need = footprint(info, config, dtype_bytes, pin_supported, component_roles)
    if free_bytes is None or need.device_bytes <= free_bytes:
        return need
    suggestion = "no model-level offload config fits: even the largest single group does not"
    for candidate in _CANDIDATES:
        parsed = parse_diffusion_offload_config(candidate)
        alt = footprint(info, parsed, dtype_bytes, pin_supported, component_roles)
        if alt.device_bytes <= free_bytes:
            suggestion = (
                f"try --diffusion-offload-config '{parsed.to_json()}' "
                f"(needs {alt.device_bytes} bytes on the device)"
            )
            break
    current = config.to_json() if config is not None else "no offload"
    raise FitError(
        f"model does not fit: config {current} needs {need.device_bytes} bytes of device "
        f"memory at rest (largest group {list(need.largest_group)} plus residents) but "
        f"only {free_bytes} bytes are free; {suggestion}"
    )
