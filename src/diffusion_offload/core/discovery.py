"""Finding a pipeline's components and their roles (SPEC section 6).

Two sources, in this order:

1. ``SupportsComponentDiscovery``: the pipeline class lists its modules by role in
   ClassVars (entries may be dotted paths such as ``"encoders.text"``).
2. A diffusers ``DiffusionPipeline``: every ``nn.Module`` in ``pipeline.components`` is
   classified by name with the one table ``DIFFUSERS_ROLE_TABLE`` (it covers every
   component name of every pipeline class diffusers 0.42 exports; a test walks them).
   A name the table does not know stays resident on the device with one warning naming it.

In both, ``component_roles`` (name -> role) overrides the classification.

Roles: ``dit`` (a denoiser: ``transformer``, ``unet``, ``prior``, ``decoder``...),
``adapter`` (a network that runs inside the denoising loop beside the DiT: ControlNets,
T2I adapters; selected with ``"dit"`` and loaded and evicted with the DiT group),
``text_encoder``, ``encoder`` (image encoders, MLLMs, prompt enhancers...: never selected
by an explicit config, offloaded under legacy ``enable_cpu_offload``), ``vae`` (VAEs and
other decoders of the latents: VQ models, vocoders; resident, hooked), ``resident``
(stays on the device, not hooked).
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from torch import nn

__all__ = [
    "DIFFUSERS_ROLE_TABLE",
    "DIT_GROUP_ROLES",
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

ROLES: tuple[str, ...] = ("dit", "adapter", "text_encoder", "encoder", "vae", "resident")

#: roles whose modules run as a stage of a request (each gets a hook); ``resident`` never moves
STAGE_ROLES: tuple[str, ...] = ("dit", "adapter", "text_encoder", "encoder", "vae")

#: roles that encode the request (text encoders, image encoders): one group in module mode
ENCODER_ROLES: tuple[str, ...] = ("text_encoder", "encoder")

#: roles of the denoising loop: selected with ``"dit"``; an adapter joins its DiT's group
DIT_GROUP_ROLES: tuple[str, ...] = ("dit", "adapter")

#: diffusers component name (exact, or an ``fnmatch`` pattern) -> role; the first row that
#: matches wins. An ``encoder`` whose name has the token ``text`` (``is_text_encoder_path``)
#: is a ``text_encoder``. Built from the ``__init__`` signatures of diffusers 0.42's
#: pipeline classes (``tests/test_discovery.py`` walks them all).
DIFFUSERS_ROLE_TABLE: tuple[tuple[str, str], ...] = (
    # denoisers (run every step)
    ("transformer", "dit"),
    ("transformer_*", "dit"),
    ("unconditional_transformer", "dit"),  # Ideogram 4
    ("unet", "dit"),
    ("unet_*", "dit"),
    ("image_unet", "dit"),  # Versatile Diffusion
    ("text_unet", "dit"),
    ("prior", "dit"),  # Shap-E, Kandinsky priors
    ("prior_prior", "dit"),  # Kandinsky / Wuerstchen / Stable Cascade combined pipelines
    ("decoder", "dit"),  # Wuerstchen / Stable Cascade decoder, unCLIP
    ("super_res_first", "dit"),  # unCLIP
    ("super_res_last", "dit"),
    ("latent_upsampler", "dit"),  # LTX, LTX-2
    ("temporal_latent_upsampler", "dit"),
    ("latent_upscaler", "dit"),  # Kandinsky 6 SR
    # adapters inside the denoising loop (the DiT group)
    ("controlnet", "adapter"),
    ("controlnet_*", "adapter"),
    ("adapter", "adapter"),  # T2I-Adapter
    ("motion_adapter", "adapter"),  # AnimateDiff (copied into the UNet; never runs itself)
    ("brushnet", "adapter"),
    # decoders of the latents
    ("vae", "vae"),
    ("vae_*", "vae"),
    ("audio_vae", "vae"),
    ("movq", "vae"),  # Kandinsky
    ("vqgan", "vae"),  # Wuerstchen, Stable Cascade
    ("vqvae", "vae"),  # aMUSEd, VQ-Diffusion
    ("vocoder", "vae"),  # AudioLDM, MusicLDM, LTX-2
    ("diffusion_decoder", "vae"),  # LTX-2
    ("sound_tokenizer", "vae"),  # Cosmos 3
    ("audio_token_detokenizer", "vae"),  # ACE-Step
    ("text_decoder", "vae"),  # UniDiffuser (latents -> text)
    ("shap_e_renderer", "vae"),  # Shap-E (latents -> images)
    # prompt encoding
    ("bert", "text_encoder"),  # LDM text-to-image
    ("language_model", "text_encoder"),  # AudioLDM 2
    ("projection_model", "text_encoder"),  # AudioLDM 2, Stable Audio
    ("*encoder*", "encoder"),  # text_encoder*, image_encoder, prior_text_encoder...
    # other conditioning networks that run before the denoising loop
    ("audio_tokenizer", "encoder"),  # ACE-Step
    ("caption_generator", "encoder"),  # Pix2Pix-Zero (BLIP)
    ("connectors", "encoder"),  # LTX-2 text connectors
    ("depth_estimator", "encoder"),  # SD depth-to-image (DPT)
    ("duration_embedder", "encoder"),  # Stable Audio 3
    ("duration_head", "encoder"),  # LTX-2
    ("image_embedder", "encoder"),  # FLUX prior Redux
    ("image_project", "encoder"),  # GLIGEN
    ("pe", "encoder"),  # ERNIE-Image prompt enhancer
    ("prompt_enhancer", "encoder"),  # LTX-2
    ("prompt_enhancer_head", "encoder"),  # Ideogram 4
    ("qformer", "encoder"),  # BLIP-Diffusion
    ("siglip", "encoder"),  # Z-Image Omni
    ("safety_checker", "encoder"),  # runs on the decoded images
    # small helpers that stay on the device
    ("image_normalizer", "resident"),  # stable unCLIP
    ("learned_classifier_free_sampling_embeddings", "resident"),  # VQ-Diffusion
    ("text_proj", "resident"),  # unCLIP
    ("watermarker", "resident"),  # DeepFloyd IF
)


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
    """The role of a diffusers pipeline component named ``name`` (the first row of
    ``DIFFUSERS_ROLE_TABLE`` that matches; an encoder named with the token ``text`` is a
    ``text_encoder``), or None if no row matches."""
    for pattern, role in DIFFUSERS_ROLE_TABLE:
        if fnmatch.fnmatchcase(name, pattern):
            if role == "encoder" and is_text_encoder_path(name):
                return "text_encoder"
            return role
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
                f"{{{name!r}: {' | '.join(repr(r) for r in ROLES)}}}",
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
