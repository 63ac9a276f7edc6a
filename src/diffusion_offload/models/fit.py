"""The fit check: will a config's resting footprint fit the device, before any weight loads?

At rest under model-level offload the device holds the residents (VAEs, unselected
components) plus the largest group that takes its turn: one selected DiT, or all
selected encoders together (text encoders of one pipeline run back to back and do not
evict each other). Host memory holds every selected component (pinned when pinning is
on and supported). Activations come on top of this; the check is for weights.

In layer mode the device holds the residents, the trunk of every selected component
(everything outside its blocks), the ``resident_layers`` of each selected DiT and the two
largest streamed blocks (the one that runs and the one being prefetched); the streamed
blocks live on the host. Block sizes come from the tensor names in the safetensors
headers, grouped by the block containers of ``blocks.block_attrs``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..core.config import DiffusionOffloadConfig, parse_diffusion_offload_config
from ..core.discovery import diffusers_role
from .files import ModelInfo, _DTYPE_BYTES, _FLOAT_DTYPES, safetensors_tensors, weight_files

__all__ = ["FitError", "Footprint", "check_fit", "footprint"]


class FitError(ValueError):
    """The device cannot hold what the chosen config keeps on it."""


@dataclass(frozen=True)
class Footprint:
    """Bytes a config needs.

    Attributes:
        device_bytes: residents + the largest group (weights only); layer mode: residents
            + trunks + resident layers + the two largest streamed blocks.
        host_bytes: bytes of the components that move to the host.
        pinned_bytes: of those, bytes pinned (0 when pinning is off or unsupported).
        largest_group: names of the components in the largest group (layer mode: the
            two largest streamed blocks, as ``component.block``).
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


def _component_class(info: ModelInfo, name: str) -> type | None:
    library, class_name = info.components.get(name, ("", ""))
    try:
        return getattr(importlib.import_module(library), class_name)
    except Exception:  # an unknown library or class: the table by name still applies
        return None


def block_sizes(
    info: ModelInfo,
    name: str,
    dtype_bytes: int | None,
    override: Sequence[str] | None = None,
) -> tuple[int, list[tuple[str, int]]]:
    """Split component ``name`` into its trunk bytes and its blocks' bytes, from headers.

    Returns:
        ``(trunk_bytes, [(block name, bytes), ...])`` with blocks in container order
        (``"blocks.0"``, ...). No blocks found: ``(component bytes, [])``.
    """
    from ..core.blocks import BUILTIN_BLOCK_ATTRS, PATH_ALTERNATIVES

    cls = _component_class(info, name)
    paths: tuple[str, ...] = ()
    if override is not None:
        paths = tuple(override)
    elif cls is not None and getattr(cls, "_layerwise_offload_blocks_attrs", None):
        paths = tuple(cls._layerwise_offload_blocks_attrs)
    else:
        names = [c.__name__ for c in cls.__mro__] if cls is not None else [info.components.get(name, ("", ""))[1]]
        for n in names:
            if n in BUILTIN_BLOCK_ATTRS:
                paths = BUILTIN_BLOCK_ATTRS[n]
                break
    candidates = [(p, p) for p in paths] + [(PATH_ALTERNATIVES[p], p) for p in paths if p in PATH_ALTERNATIVES]
    files = weight_files(info.path, info.variant).get(name, [])
    trunk = 0
    blocks: dict[tuple[int, int], tuple[str, int]] = {}
    for key, (dtype, numel) in safetensors_tensors(files).items():
        size = numel * (dtype_bytes if (dtype_bytes and dtype in _FLOAT_DTYPES) else _DTYPE_BYTES[dtype])
        for prefix, canonical in candidates:
            if key.startswith(prefix + "."):
                idx = key[len(prefix) + 1:].split(".", 1)[0]
                if idx.isdigit():
                    order = (paths.index(canonical), int(idx))
                    label, total = blocks.get(order, (f"{canonical}.{idx}", 0))
                    blocks[order] = (label, total + size)
                    break
        else:
            trunk += size
    return trunk, [blocks[k] for k in sorted(blocks)]


def _layer_footprint(
    info: ModelInfo,
    config: DiffusionOffloadConfig,
    sizes: dict[str, int],
    roles: dict[str, str],
    dtype_bytes: int | None,
    pin_supported: bool,
    layer_blocks: Mapping[str, Sequence[str]] | None,
) -> Footprint:
    resident_layers = 0
    for comp, opts in config.layer_options:
        if comp == "dit" and opts.resident_layers is not None:
            resident_layers = opts.resident_layers
    device = 0
    host = 0
    streamed: list[tuple[int, str]] = []
    for name, size in sizes.items():
        role = roles[name]
        if role not in ("dit", "text_encoder") or not config.selects(role):
            device += size
            continue
        trunk, blocks = block_sizes(info, name, dtype_bytes, (layer_blocks or {}).get(name))
        keep = resident_layers if role == "dit" else 0
        device += trunk + sum(b for _, b in blocks[:keep])
        for label, b in blocks[keep:]:
            streamed.append((b, f"{name}.{label}"))
            host += b
    two = sorted(streamed, reverse=True)[:2]
    pinned = host if (config.pin_memory and pin_supported) else 0
    return Footprint(device + sum(b for b, _ in two), host, pinned, tuple(n for _, n in two))


def footprint(
    info: ModelInfo,
    config: DiffusionOffloadConfig | None,
    dtype_bytes: int | None,
    pin_supported: bool,
    component_roles: Mapping[str, str] | None = None,
    layer_blocks: Mapping[str, Sequence[str]] | None = None,
) -> Footprint:
    """Compute the resting device, host and pinned bytes of ``config`` for ``info``.

    ``config=None`` means no offload: everything on the device. ``dtype_bytes`` is the
    element size the floating weights are loaded in (None: as stored).
    ``layer_blocks``: layer mode's container overrides per component.
    """
    sizes = {n: info.component_bytes(n, dtype_bytes) for n in info.numels}
    roles = _roles(info, component_roles)
    if config is None:
        return Footprint(sum(sizes.values()), 0, 0, tuple(sizes))
    if config.mode == "layer":
        return _layer_footprint(info, config, sizes, roles, dtype_bytes, pin_supported, layer_blocks)
    moving = {n for n, r in roles.items() if config.offloads_role(r)}
    resident = sum(s for n, s in sizes.items() if n not in moving)
    adapters = tuple(n for n in moving if roles[n] == "adapter")  # they join each DiT's group
    groups = [(n, *adapters) for n in moving if roles[n] == "dit"]
    encoders = tuple(n for n in moving if roles[n] not in ("dit", "adapter"))
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
    {"mode": "layer", "components": ["dit", "text_encoder"]},
)


def check_fit(
    info: ModelInfo,
    config: DiffusionOffloadConfig | None,
    dtype_bytes: int | None,
    free_bytes: int | None,
    pin_supported: bool,
    component_roles: Mapping[str, str] | None = None,
    layer_blocks: Mapping[str, Sequence[str]] | None = None,
    advise: Callable[[], str | None] | None = None,
) -> Footprint:
    """Return the footprint, or raise ``FitError`` if it exceeds ``free_bytes``.

    The error gives the bytes needed and the bytes free, and a suggestion: ``advise()``'s
    (the engine passes the planner's, from predicted peaks) when it gives one, else the
    first config (fewest components moved) whose resting footprint fits, or that none does.

    Raises:
        FitError: the resting device bytes exceed ``free_bytes``.
    """
    need = footprint(info, config, dtype_bytes, pin_supported, component_roles, layer_blocks)
    if free_bytes is None or need.device_bytes <= free_bytes:
        return need
    suggestion = advise() if advise is not None else None
    if suggestion is None:
        suggestion = _resting_suggestion(info, dtype_bytes, free_bytes, pin_supported, component_roles)
    current = config.to_json() if config is not None else "no offload"
    raise FitError(
        f"model does not fit: config {current} needs {need.device_bytes} bytes of device "
        f"memory at rest ({'largest group' if config is None or config.mode == 'module' else 'trunks, two largest blocks'} "
        f"{list(need.largest_group)} plus residents) but "
        f"only {free_bytes} bytes are free; {suggestion}"
    )


def _resting_suggestion(info: ModelInfo, dtype_bytes: int | None, free_bytes: int,
                        pin_supported: bool, component_roles: Mapping[str, str] | None) -> str:
    suggestion = "no offload config fits: not even layer mode's trunks and two blocks"
    for candidate in _CANDIDATES:
        parsed = parse_diffusion_offload_config(candidate)
        alt = footprint(info, parsed, dtype_bytes, pin_supported, component_roles)
        if alt.device_bytes <= free_bytes:
            suggestion = (
                f"try --diffusion-offload-config '{parsed.to_json()}' "
                f"(needs {alt.device_bytes} bytes on the device)"
            )
            break
    return suggestion
