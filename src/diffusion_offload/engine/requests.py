"""One request's pipeline arguments: knobs, the negative-prompt rule, ``check_inputs``,
and the per-request scheduler shift and expert boundary (set for the call, then restored).

:class:`Omni` builds every ``__call__`` through :func:`call_kwargs` and runs it inside
:func:`request_overrides`; ``serve`` calls :func:`check_request` (through
``Omni.check_request``) when a request arrives, so what the pipeline would refuse is a
400 at creation rather than a failed job.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .knobs import DEFAULT_TRUE_CFG_SCALE, Knob, KnobError, check_knob, refusal
from .params import SamplingParams

logger = logging.getLogger("diffusion_offload.engine")

__all__ = ["PromptItem", "call_kwargs", "check_arguments", "check_request", "normalize_prompts", "request_overrides",
           "shift_key", "variant_for"]

_NAMED = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale",
          "guidance_scale_2")


_ITEM_KEYS = ("prompt", "negative_prompt", "image", "mask")


@dataclass(frozen=True)
class PromptItem:
    """One prompt of ``Omni.generate``.

    Attributes:
        prompt: the text.
        negative: the negative prompt, or None.
        images: the images to edit (PIL), or None (text-to-image or -video).
        mask: the inpainting mask (PIL; white is repainted), or None.
    """

    prompt: str
    negative: str | None = None
    images: tuple[Any, ...] | None = None
    mask: Any = None

    def images_kwargs(self) -> dict[str, Any]:
        """``image`` (one image, or a list of several) and ``mask_image`` for ``__call__``."""
        out: dict[str, Any] = {}
        if self.images:
            out["image"] = self.images[0] if len(self.images) == 1 else list(self.images)
        if self.mask is not None:
            out["mask_image"] = self.mask
        return out


def normalize_prompts(prompts: Any) -> list[PromptItem]:
    """``Omni.generate``'s prompts as items.

    Raises:
        ValueError: empty, unknown keys, or a mask without an image.
        TypeError: a value of the wrong type (a non-PIL image, a non-str prompt).
    """
    from PIL import Image

    items = prompts if isinstance(prompts, list) else [prompts]
    if not items:
        raise ValueError("prompts must not be empty")
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(PromptItem(item))
            continue
        if not isinstance(item, Mapping):
            raise TypeError(
                f"prompts must be a str, a dict with 'prompt' (and 'negative_prompt', 'image', "
                f"'mask'), or a list of them; got {item!r} ({type(item).__name__})"
            )
        unknown = set(item) - set(_ITEM_KEYS)
        if unknown:
            raise ValueError(f"prompt dict has unknown keys {sorted(unknown)}; allowed: {list(_ITEM_KEYS)}")
        prompt, negative = item.get("prompt"), item.get("negative_prompt")
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {prompt!r}")
        if negative is not None and not isinstance(negative, str):
            raise TypeError(f"negative_prompt must be a str or None, got {negative!r}")
        image, mask = item.get("image"), item.get("mask")
        images = None
        if image is not None:
            images = tuple(image) if isinstance(image, (list, tuple)) else (image,)
            if not images or not all(isinstance(i, Image.Image) for i in images):
                raise TypeError(f"image must be a PIL image or a list of them, got {image!r}")
        if mask is not None and not isinstance(mask, Image.Image):
            raise TypeError(f"mask must be a PIL image, got {mask!r}")
        if mask is not None and images is None:
            raise ValueError("a mask needs an image to inpaint")
        out.append(PromptItem(prompt, negative, images, mask))
    return out


def variant_for(pipeline: Any, item: PromptItem) -> str | None:
    """Which pipeline runs ``item``: None for the served one (no image, or a pipeline
    whose ``__call__`` takes the image itself: Qwen-Image-Edit, FLUX.1-Kontext,
    image-to-video), ``"image2image"``, or with a mask ``"inpaint"``."""
    if item.images is None:
        return None
    params = inspect.signature(pipeline.__call__).parameters
    if "image" in params and (item.mask is None or "mask_image" in params):
        return None
    return "inpaint" if item.mask is not None else "image2image"


def image_input(pipeline: Any) -> str | None:
    """How ``pipeline.__call__`` takes an input ``image``: ``"required"`` (image-to-video:
    ``WanImageToVideoPipeline``; a prompt without one cannot run), ``"optional"`` (edit
    models: FLUX.1-Kontext, Qwen-Image-Edit) or None (text-to-image/video only)."""
    param = inspect.signature(pipeline.__call__).parameters.get("image")
    if param is None:
        return None
    return "required" if param.default is inspect.Parameter.empty else "optional"


def shift_key(scheduler: Any) -> str | None:
    """The scheduler config key that ``flow_shift`` sets: ``flow_shift`` (UniPC, DPM),
    ``shift`` (FlowMatchEuler), or None when it has neither."""
    config = getattr(scheduler, "config", {}) or {}
    for key in ("flow_shift", "shift"):
        if key in config:
            return key
    return None


def _check_overrides(pipeline: Any, params: SamplingParams) -> None:
    cls = type(pipeline).__name__
    if params.flow_shift is not None:
        scheduler = getattr(pipeline, "scheduler", None)
        key = shift_key(scheduler)
        if key is None:
            raise KnobError("flow_shift", f"'flow_shift' is not supported by {cls}: its scheduler "
                                          f"{type(scheduler).__name__} has no shift.")
        if scheduler.config.get("use_dynamic_shifting"):
            raise KnobError("flow_shift", f"'flow_shift' is not supported by {cls}: its scheduler "
                                          "uses dynamic shifting (use_dynamic_shifting=True), so "
                                          "the shift follows the image size.")
    if params.boundary_ratio is not None and (
            "boundary_ratio" not in pipeline.config or getattr(pipeline, "transformer_2", None) is None):
        raise KnobError("boundary_ratio", f"'boundary_ratio' is not supported by {cls}: it is the "
                                          "switch between Wan2.2's two experts, and this model has one.")


def call_kwargs(pipeline: Any, knobs: Mapping[str, Knob], refused: Mapping[str, str],
                params: SamplingParams, has_negative: bool, max_items: int = 1001) -> dict[str, Any]:
    """The ``__call__`` keyword arguments of ``params`` (prompt, generator excluded).

    ``params.extra`` is checked knob by knob (:func:`~.knobs.check_knob`); a negative
    prompt on a pipeline that uses it only when ``true_cfg_scale > 1`` gets
    :data:`~.knobs.DEFAULT_TRUE_CFG_SCALE` when ``true_cfg_scale`` is unset.

    Raises:
        KnobError: an argument the pipeline does not take (the message lists those it
            does), one the engine sets, a bad value, an explicit ``true_cfg_scale`` of 1
            or less with a negative prompt, or ``flow_shift``/``boundary_ratio`` on a
            model without them.
    """
    cls = type(pipeline).__name__
    kwargs: dict[str, Any] = {}
    for key in _NAMED:
        value = getattr(params, key)
        if value is None:
            continue
        if key not in knobs:
            raise KnobError(key, f"SamplingParams.{key}={value!r} is not supported by {cls} "
                                 f"(it takes no {key!r})")
        kwargs[key] = value
    for key, value in (params.extra or {}).items():
        if key in refused:
            raise refusal(key, refused[key])
        if key not in knobs or key in kwargs or key == "negative_prompt":
            taken = ", ".join(sorted(set(knobs) - {"negative_prompt"}))
            why = "is given twice" if key in kwargs else f"is not an argument of {cls}"
            raise KnobError(key, f"Unrecognized argument '{key}': it {why}; {cls} takes: {taken}.")
        if value is not None:
            kwargs[key] = check_knob(knobs[key], value, max_items=max_items)
    if has_negative and "true_cfg_scale" in knobs:
        scale = kwargs.get("true_cfg_scale")
        if scale is None:
            kwargs["true_cfg_scale"] = DEFAULT_TRUE_CFG_SCALE
        elif scale <= 1:
            raise KnobError("true_cfg_scale", f"'negative_prompt' needs 'true_cfg_scale' > 1 on {cls} "
                                              f"(it is used only then), got true_cfg_scale={scale:g}; "
                                              "raise it or drop the negative prompt.")
    _check_overrides(pipeline, params)
    return kwargs


class _ConfigView:
    """The pipeline seen by ``check_inputs`` with this request's ``boundary_ratio``:
    every attribute is the pipeline's, except ``config``."""

    def __init__(self, pipeline: Any, own_config: Mapping[str, Any],
                 boundary_ratio: float | None) -> None:
        from diffusers.configuration_utils import FrozenDict

        self._pipeline = pipeline
        config = dict(own_config)
        if boundary_ratio is not None:
            config["boundary_ratio"] = boundary_ratio
        self.config = FrozenDict(config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)


_PROMPTS = ("prompt", "negative_prompt")


def _default_size(pipeline: Any) -> int | None:
    """The side ``__call__`` gives an omitted ``height``/``width`` before it runs
    ``check_inputs`` (``default_sample_size * vae_scale_factor``: FLUX, SD3, Qwen-Image and
    their image-to-image and inpainting variants), or None when the pipeline has no such rule."""
    size = getattr(pipeline, "default_sample_size", None)
    factor = getattr(pipeline, "vae_scale_factor", None)
    if isinstance(size, int) and isinstance(factor, int) and not isinstance(size, bool):
        return size * factor
    return None


def check_arguments(pipeline: Any, item: PromptItem,
                    kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``check_inputs``' keyword arguments for this request, as ``__call__`` passes them.

    A value the request gives is used as is (``output_type`` is ``"pil"``, as the engine
    runs every call); one it leaves out takes ``__call__``'s default for that name
    (``strength=0.6`` of the image-to-image variants), an omitted ``height``/``width``
    the side ``__call__`` computes (:func:`_default_size`); a required argument still
    without a value gets None.

    Returns:
        ``(args, unknown)``: the arguments, and the names of the required ones the request
        did not give whose value here is None, prompts aside (``prompt_2``,
        ``negative_prompt``: ``__call__`` passes them as given): ``__call__`` may derive
        those first (``num_frames``, a ``height`` without :func:`_default_size`).
    """
    check = type(pipeline).check_inputs
    call = inspect.signature(type(pipeline).__call__).parameters
    values = {"prompt": item.prompt, "negative_prompt": item.negative, "output_type": "pil",
              **kwargs, **item.images_kwargs()}
    args: dict[str, Any] = {}
    unknown: list[str] = []
    for name, param in inspect.signature(check).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in values:
            args[name] = values[name]
            continue
        default = call[name].default if name in call else inspect.Parameter.empty
        if default is not inspect.Parameter.empty:
            args[name] = default
        elif param.default is inspect.Parameter.empty:
            args[name] = None
        if name in ("height", "width") and args.get(name) is None and name in args:
            args[name] = _default_size(pipeline)
        if param.default is inspect.Parameter.empty and args.get(name) is None \
                and not name.startswith(_PROMPTS):
            unknown.append(name)
    return args, unknown


def check_request(pipeline: Any, own_config: Mapping[str, Any], item: PromptItem,
                  kwargs: Mapping[str, Any], params: SamplingParams) -> bool:
    """Run the pipeline's own ``check_inputs`` on this request, without running it.

    The arguments are those ``__call__`` would pass (:func:`check_arguments`). The
    pipeline is seen with its own config (``own_config``, as loaded) and this request's
    ``boundary_ratio``, never another request's running override.

    Returns:
        True when the check ran; False when the pipeline has no ``check_inputs``, or when
        it failed with something other than a ``ValueError`` on an argument the request
        left out and ``__call__`` derives (a ``None < 0`` of a value not known here): the
        pipeline then checks it itself when it runs.

    Raises:
        ValueError: what ``check_inputs`` raises, its message kept (a refusal).
        Exception: anything else ``check_inputs`` raises when every argument it needs
            was known: a fault, not a refusal of the request.
    """
    if getattr(type(pipeline), "check_inputs", None) is None:
        return False
    args, unknown = check_arguments(pipeline, item, kwargs)
    view = _ConfigView(pipeline, own_config, params.boundary_ratio)
    try:
        type(pipeline).check_inputs(view, **args)
    except ValueError:
        raise
    except Exception as exc:
        if not unknown:
            raise
        logger.debug("%s.check_inputs could not run before the call (%s: %s) with %s not "
                     "known here; the pipeline checks them when it runs",
                     type(pipeline).__name__, type(exc).__name__, exc, ", ".join(unknown))
        return False
    return True


@contextlib.contextmanager
def request_overrides(pipeline: Any, params: SamplingParams) -> Iterator[None]:
    """Set this request's ``flow_shift`` (a scheduler built from the pipeline's with the
    shift) and ``boundary_ratio`` for the call; the model's own come back afterwards,
    also when the call raises. The caller serializes calls (``Omni``'s lock)."""
    scheduler = pipeline.scheduler if params.flow_shift is not None else None
    ratio = pipeline.config.get("boundary_ratio") if params.boundary_ratio is not None else None
    try:
        if scheduler is not None:
            key = shift_key(scheduler)
            pipeline.scheduler = type(scheduler).from_config(scheduler.config, **{key: params.flow_shift})
        if params.boundary_ratio is not None:
            pipeline.register_to_config(boundary_ratio=params.boundary_ratio)
        yield
    finally:
        if scheduler is not None:
            pipeline.scheduler = scheduler
        if params.boundary_ratio is not None:
            pipeline.register_to_config(boundary_ratio=ratio)
