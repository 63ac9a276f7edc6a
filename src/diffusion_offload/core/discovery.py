"""Finding a pipeline's components and their roles (SPEC section 6).

Two sources, in this order:

1. ``SupportsComponentDiscovery``: the pipeline class lists its modules by role in
   ClassVars (entries may be dotted paths such as ``"encoders.text"``).
2. A diffusers ``DiffusionPipeline``: every ``nn.Module`` in ``pipeline.components`` is
   classified by name (``transformer``, ``transformer_2``, ``unet`` -> DiT;
   ``text_encoder*`` -> text encoder; other ``*encoder*`` -> encoder; ``vae``,
   ``audio_vae`` -> VAE). A name the map does not know stays resident on the device
   with one warning naming it.

In both, ``component_roles`` (name -> role) overrides the classification.

Roles: ``dit`` (denoiser), ``text_encoder``, ``encoder`` (image encoders, MLLMs...:
never selected by an explicit config, offloaded under legacy ``enable_cpu_offload``),
``vae`` (resident, hooked), ``resident`` (stays on the device, not hooked).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

__all__ = [
    "ENCODER_ROLES",
    "ROLES",
    "STAGE_ROLES",
    "Component",
    "SupportsComponentDiscovery",
    "diffusers_role",
    "is_text_encoder_path",
    "discover_components",
    "resolve_module",
]

ROLES: tuple[str, ...] = ("dit", "text_encoder", "encoder", "vae", "resident")

#: roles whose modules run as a stage of a request (each gets a hook); ``resident`` never moves
STAGE_ROLES: tuple[str, ...] = ("dit", "text_encoder", "encoder", "vae")

#: roles that encode the request (text encoders, image encoders): one group in module mode
ENCODER_ROLES: tuple[str, ...] = ("text_encoder", "encoder")


class SupportsComponentDiscovery:
    """Mixin for pipelines that declare their components.

    Subclasses set the four ClassVars to lists of attribute names or dotted paths. DiT
    and encoder lists are both needed for mutual exclusion; an encoder counts as a
    ``text_encoder`` when ``is_text_encoder_path`` says so (the token ``text`` in the last
    dotted segment split on ``_``).
    """

    _dit_modules: ClassVar[list[str]] = []
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []


@dataclass(frozen=True)
class Component:
    """One discovered component.

    Attributes:
        name: the attribute name or dotted path in the pipeline.
        module: the ``nn.Module``.
        role: one of ``ROLES``.
    """

    name: str
    module: nn.Module
    role: str


def resolve_module(root: Any, path: str) -> nn.Module:
    """Follow the dotted ``path`` from ``root`` and return the ``nn.Module`` there.

    Raises:
        ValueError: a segment is missing or the target is not an ``nn.Module``.
    """
    obj = root
    for part in path.split("."):
        if isinstance(obj, nn.Module) and part in obj._modules:
            obj = obj._modules[part]
        elif hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            raise ValueError(
                f"component path {path!r}: {type(obj).__name__} has no attribute {part!r}"
            )
    if not isinstance(obj, nn.Module):
        raise ValueError(
            f"component path {path!r} resolves to {type(obj).__name__}, not an nn.Module"
        )
    return obj


def is_text_encoder_path(path: str) -> bool:
    """Whether the encoder at ``path`` is a text encoder (SPEC section 6).

    True when the last dotted segment, split on ``_``, has the token ``text``:
    ``text_encoder_2``, ``encoders.text`` and ``my_text_encoder`` are text encoders;
    ``context.vision_encoder`` and ``context_encoder`` are not.
    """
    return "text" in path.rsplit(".", 1)[-1].lower().split("_")


def diffusers_role(name: str) -> str | None:
    """The role of a diffusers pipeline component named ``name``, or None if unknown."""
    if name in ("transformer", "unet") or name.startswith(("transformer_", "unet_")):
        return "dit"
    if "encoder" in name:
        return "text_encoder" if is_text_encoder_path(name) else "encoder"
    if name in ("vae", "audio_vae") or name.startswith("vae_"):
        return "vae"
    return None


def _check_roles(component_roles: Mapping[str, str] | None, known: list[str]) -> dict[str, str]:
    if component_roles is None:
        return {}
    if not isinstance(component_roles, Mapping):
        raise TypeError(
            f"component_roles must be a mapping of component name -> role, got "
            f"{component_roles!r} ({type(component_roles).__name__})"
        )
    out: dict[str, str] = {}
    for name, role in component_roles.items():
        if not isinstance(name, str) or not isinstance(role, str):
            raise TypeError(
                f"component_roles entries must be str -> str, got {name!r}: {role!r}"
            )
        if role not in ROLES:
            raise ValueError(
                f"component_roles[{name!r}]={role!r} is not allowed; allowed roles: {list(ROLES)}"
            )
        if name not in known:
            raise ValueError(
                f"component_roles names {name!r}, which is not a module component of the "
                f"pipeline; components: {sorted(known)}"
            )
        out[name] = role
    return out


def _declared(pipeline: SupportsComponentDiscovery) -> list[tuple[str, str]]:
    cls = type(pipeline)
    pairs: list[tuple[str, str]] = []
    for path in cls._dit_modules:
        pairs.append((path, "dit"))
    for path in cls._encoder_modules:
        pairs.append((path, "text_encoder" if is_text_encoder_path(path) else "encoder"))
    for path in cls._vae_modules:
        pairs.append((path, "vae"))
    for path in cls._resident_modules:
        pairs.append((path, "resident"))
    return pairs


def discover_components(
    pipeline: Any, component_roles: Mapping[str, str] | None = None
) -> list[Component]:
    """Classify every component of ``pipeline``.

    Args:
        pipeline: a ``SupportsComponentDiscovery`` object or a diffusers pipeline
            (anything with a ``components`` dict).
        component_roles: overrides, name -> role (one of ``ROLES``).

    Returns:
        The components in declaration order; ``None`` components are skipped.

    Raises:
        TypeError: ``pipeline`` offers neither way of discovery, or ``component_roles``
            has the wrong types.
        ValueError: a declared path does not resolve, a module is listed twice, or an
            override names an unknown component or role.
    """
    if isinstance(pipeline, SupportsComponentDiscovery):
        pairs = []
        for path, role in _declared(pipeline):
            try:
                module = resolve_module(pipeline, path)
            except ValueError:
                if _optional_missing(pipeline, path):
                    continue
                raise
            pairs.append((path, module, role))
    elif isinstance(getattr(pipeline, "components", None), dict):
        pairs = [
            (name, value, diffusers_role(name) or "")
            for name, value in pipeline.components.items()
            if isinstance(value, nn.Module)
        ]
    else:
        raise TypeError(
            f"cannot discover the components of {type(pipeline).__name__}: implement "
            "SupportsComponentDiscovery or pass a diffusers DiffusionPipeline"
        )
    overrides = _check_roles(component_roles, [p[0] for p in pairs])
    out: list[Component] = []
    seen: dict[int, str] = {}
    for name, module, role in pairs:
        role = overrides.get(name, role)
        if not role:
            warnings.warn(
                f"pipeline component {name!r} ({type(module).__name__}) has no known role; "
                f"it stays resident on the device. To offload it pass component_roles="
                f"{{{name!r}: 'dit' | 'text_encoder' | 'encoder' | 'vae' | 'resident'}}",
                UserWarning,
                stacklevel=3,
            )
            role = "resident"
        if id(module) in seen:
            raise ValueError(
                f"component {name!r} is the same module as {seen[id(module)]!r}; list each "
                "module once"
            )
        seen[id(module)] = name
        out.append(Component(name, module, role))
    return out


def _optional_missing(pipeline: Any, path: str) -> bool:
    """A declared top-level attribute set to None (an optional component) is skipped."""
    head, _, rest = path.partition(".")
    return getattr(pipeline, head, object()) is None
