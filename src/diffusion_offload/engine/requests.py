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
from collections.abc import Iterator, Mapping
from typing import Any

from .knobs import DEFAULT_TRUE_CFG_SCALE, Knob, KnobError, check_knob, refusal
from .params import SamplingParams

__all__ = ["call_kwargs", "check_request", "request_overrides", "shift_key"]

_NAMED = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale",
          "guidance_scale_2")


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


def check_request(pipeline: Any, own_config: Mapping[str, Any], prompt: str,
                  negative: str | None, kwargs: Mapping[str, Any], params: SamplingParams) -> None:
    """Run the pipeline's own ``check_inputs`` on this request, without running it.

    The pipeline is seen with its own config (``own_config``, as loaded) and this
    request's ``boundary_ratio``, never another request's running override.

    Raises:
        ValueError: what ``check_inputs`` raises, its message kept.
    """
    check = getattr(type(pipeline), "check_inputs", None)
    if check is None:
        return
    values = {"prompt": prompt, "negative_prompt": negative, **kwargs}
    args: dict[str, Any] = {}
    for name, param in inspect.signature(check).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in values:
            args[name] = values[name]
        elif param.default is inspect.Parameter.empty:
            args[name] = None  # prompt_2, image...: not given
    check(_ConfigView(pipeline, own_config, params.boundary_ratio), **args)


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
