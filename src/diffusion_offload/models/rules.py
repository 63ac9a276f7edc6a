"""What a model accepts, read from its files before it loads; request defaults; building Omni.

Shared by ``diffusion-offload generate`` and ``serve``: both check sizes and frame counts
against the model's own rules (VAE scale factor times the transformer's patch size;
the VAE's temporal factor) before any weight is read, and both resolve omitted fields
the same way: a ``make-tiny`` model's small defaults, else the pipeline's.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing models.files imports diffusers; the Ray ingress needs neither
    from .files import ModelInfo

__all__ = ["DEFAULT_FPS", "ModelRules", "frames_for_seconds", "model_rules"]

DEFAULT_FPS = 16
"""Frames per second of a video when none is given (Wan's native rate)."""

# pipelines that pack 2x2 latent patches regardless of the transformer's patch_size
_PACKING = ("Flux", "QwenImage")


@dataclass(frozen=True)
class ModelRules:
    """Sizes a pipeline accepts and its defaults, from its config files.

    Attributes:
        pipeline_class: ``_class_name`` of ``model_index.json``.
        is_video: the pipeline makes videos.
        size_multiple: height and width must be multiples of this (pixels).
        frame_step: ``num_frames - 1`` must be a multiple of this, or None.
        defaults: the omitted-field values: ``height``, ``width`` (pixels),
            ``num_inference_steps``, and ``num_frames`` for video models; a value is None
            where neither a make-tiny marker nor the pipeline's signature gives one.
        tiny_kind: the make-tiny kind of the folder, or None.
        max_side: largest height and width (pixels) the transformer's position table
            covers, or None (no such limit in its config).
        max_frames: most frames it covers, or None.
        limit_source: where ``max_side``/``max_frames`` come from, for messages
            (``"its transformer's rope_max_seq_len of 32"``).
    """

    pipeline_class: str
    is_video: bool
    size_multiple: int
    frame_step: int | None
    defaults: dict[str, int | None] = field(default_factory=dict)
    tiny_kind: str | None = None
    max_side: int | None = None
    max_frames: int | None = None
    limit_source: str = ""

    def check(self, values: Mapping[str, int | None], names: Mapping[str, str]) -> None:
        """Check ``height``/``width``/``num_frames`` in ``values`` against the rules.

        Args:
            values: field -> value (None: not given).
            names: field -> how the user spelled it (``"--height"``, ``"size"``).

        Raises:
            ValueError: one line naming the field, the value and what is allowed.
        """
        m = self.size_multiple
        for key in ("height", "width"):
            value = values.get(key)
            if value is not None and value % m:
                lower = max(m, value - value % m)
                raise ValueError(
                    f"{names.get(key, key)} {value} is not allowed by {self.pipeline_class}: it must be "
                    f"a multiple of {m} (its VAE scale factor times its patch size), e.g. "
                    f"{lower} or {lower + m}"
                )
            if value is not None and self.max_side is not None and value > self.max_side:
                raise ValueError(
                    f"{names.get(key, key)} {value} is more than {self.pipeline_class} can "
                    f"generate: {self.limit_source} allows at most {self.max_side} pixels"
                )
        frames = values.get("num_frames")
        if frames is not None and self.max_frames is not None and frames > self.max_frames:
            raise ValueError(
                f"{names.get('num_frames', 'num_frames')} {frames} is more than "
                f"{self.pipeline_class} can generate: {self.limit_source} allows at most "
                f"{self.max_frames} frames"
            )
        if frames is not None:
            if not self.is_video:
                raise ValueError(f"{names.get('num_frames', 'num_frames')}: {self.pipeline_class} "
                                 "makes images, not videos")
            step = self.frame_step
            if step and (frames - 1) % step:
                lower = frames - (frames - 1) % step
                raise ValueError(
                    f"{names.get('num_frames', 'num_frames')} {frames} is not allowed by "
                    f"{self.pipeline_class}: num_frames - 1 must be a multiple of {step} "
                    f"(e.g. {lower} or {lower + step})"
                )

    def resolve(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` with each None of ``height``/``width``/``num_frames``/
        ``num_inference_steps`` replaced by this model's default."""
        out = dict(values)
        for key, default in self.defaults.items():
            if out.get(key) is None and default is not None:
                out[key] = default
        return out


def _read_config(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _vae_scale(vae: Mapping[str, Any]) -> int:
    if isinstance(vae.get("scale_factor_spatial"), int):
        return int(vae["scale_factor_spatial"])
    if isinstance(vae.get("temperal_downsample"), list):  # Qwen-Image, Wan VAE family
        return 2 ** len(vae["temperal_downsample"])
    if isinstance(vae.get("block_out_channels"), list) and vae["block_out_channels"]:
        return 2 ** (len(vae["block_out_channels"]) - 1)
    return 8


def _patch(transformer: Mapping[str, Any]) -> int:
    patch = transformer.get("patch_size", 1)
    if isinstance(patch, (list, tuple)) and patch:
        patch = patch[-1]
    return int(patch) if isinstance(patch, int) and patch > 0 else 1


def _position_limits(transformer: Mapping[str, Any], size_multiple: int,
                     frame_step: int | None) -> tuple[int | None, int | None, str]:
    """``(max_side, max_frames, source)`` from a rotary table of ``rope_max_seq_len``
    positions per axis (Wan and its family): each axis, in latent patches, must fit it."""
    positions = transformer.get("rope_max_seq_len")
    if isinstance(positions, bool) or not isinstance(positions, int) or positions < 1:
        return None, None, ""
    patch = transformer.get("patch_size")
    patch_t = patch[0] if isinstance(patch, (list, tuple)) and len(patch) == 3 else 1
    patch_t = patch_t if isinstance(patch_t, int) and patch_t > 0 else 1
    max_frames = None
    if frame_step:  # latent frames (num_frames - 1) // step + 1, in patches of patch_t
        max_frames = (positions * patch_t - 1) * frame_step + 1
    return positions * size_multiple, max_frames, f"its transformer's rope_max_seq_len of {positions}"


def model_rules(info: ModelInfo) -> ModelRules:
    """The size rules and defaults of the pipeline ``info`` describes (no weight is read).

    ``size_multiple`` is the VAE's spatial scale factor (``scale_factor_spatial``, or
    ``2 ** (len(block_out_channels) - 1)``) times the transformer's spatial patch size
    (at least 2 for Flux and Qwen-Image, which pack 2x2 latents); ``frame_step`` is the
    VAE's ``scale_factor_temporal``; ``max_side``/``max_frames`` from the transformer's
    ``rope_max_seq_len`` (positions per axis, in latent patches). Defaults come from the make-tiny marker
    (``testing.tiny_pipelines.default_call_kwargs``) or else the pipeline ``__call__``'s
    signature, with ``default_sample_size * vae scale`` where the signature has None.
    """
    import diffusers

    vae = _read_config(info.path / "vae" / "config.json")
    denoiser = "transformer" if (info.path / "transformer").is_dir() else "unet"
    transformer = _read_config(info.path / denoiser / "config.json")
    scale = _vae_scale(vae)
    patch = _patch(transformer)
    if info.pipeline_class.startswith(_PACKING):
        patch = max(patch, 2)
    temporal = vae.get("scale_factor_temporal")
    frame_step = int(temporal) if info.is_video and isinstance(temporal, int) and temporal > 1 else None
    if info.is_video and frame_step is None and info.pipeline_class.startswith("Wan"):
        frame_step = 4

    from ..testing.tiny_pipelines import default_call_kwargs, kind_of

    tiny = kind_of(info.path)
    keys = ["height", "width", "num_inference_steps"] + (["num_frames"] if info.is_video else [])
    defaults: dict[str, int | None] = {k: None for k in keys}
    if tiny is not None:
        tiny_defaults = default_call_kwargs(tiny)
        defaults.update({k: tiny_defaults.get(k) for k in keys})
    else:
        cls = getattr(diffusers, info.pipeline_class, None)
        params = inspect.signature(cls.__call__).parameters if cls is not None else {}
        for key in keys:
            default = params[key].default if key in params else None
            defaults[key] = default if isinstance(default, int) and not isinstance(default, bool) else None
        sample = transformer.get("sample_size")
        if isinstance(sample, int) and not info.pipeline_class.startswith(_PACKING):
            side = sample * scale
        else:  # Flux and Qwen-Image: diffusers' default_sample_size of 128 latent pixels
            side = 128 * scale
        for key in ("height", "width"):
            if defaults[key] is None:
                defaults[key] = side
    max_side, max_frames, source = _position_limits(transformer, scale * patch, frame_step)
    return ModelRules(info.pipeline_class, info.is_video, scale * patch, frame_step, defaults, tiny,
                      max_side, max_frames, source)


def frames_for_seconds(seconds: float, fps: int, frame_step: int | None) -> int:
    """Frames for a clip of ``seconds`` at ``fps``, rounded to the nearest count the model
    accepts (``num_frames - 1`` a multiple of ``frame_step``); at least 1."""
    frames = max(1, round(seconds * fps))
    if frame_step:
        k = max(0, round((frames - 1) / frame_step))
        frames = k * frame_step + 1
    return frames
