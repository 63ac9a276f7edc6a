"""Request models of the HTTP API and their validation into OpenAI-style 400 errors.

JSON bodies are validated strictly (``"n": "2"`` is a type error); multipart and
url-encoded forms (``/v1/videos``), whose values are all text, in lax mode (``"2"``
becomes 2). ``null`` is "not given" for every optional field. A field that is not one of
the request's own is a pipeline knob: an argument of the served pipeline's ``__call__``
(:func:`pipeline_kwargs`, typed by ``engine.knobs``); anything else is a 400 naming it
and listing what this model takes, so a typo never silently does nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..engine.knobs import Knob, KnobError, check_knob, refusal
from .errors import APIError

__all__ = [
    "ImageGenerationRequest",
    "Limits",
    "VideoGenerationRequest",
    "check_limits",
    "form_to_dict",
    "parse_size",
    "pipeline_kwargs",
    "validation_error",
]

MAX_PROMPT_CHARS = 32_000  # OpenAI's limit; the tokenizer truncates, as the pipeline does
MAX_SEED = 2**62
MAX_SIDE = 16_384
_SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX×]\s*(\d{1,6})\s*$")


def parse_size(size: str) -> tuple[int, int]:
    """``"WxH"`` -> ``(width, height)``.

    Raises:
        ValueError: not of the form ``WxH`` with positive integers up to 16384.
    """
    match = _SIZE.match(size)
    if not match:
        raise ValueError(f"size must look like 'WIDTHxHEIGHT' (e.g. '512x512'), got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
        raise ValueError(f"size {size!r}: width and height must be between 1 and {MAX_SIDE}")
    return width, height


def _check_size(value: str | None) -> str | None:
    if value is None or value == "auto":
        return None
    width, height = parse_size(value)
    return f"{width}x{height}"


_Prompt = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
_Steps = Field(None, ge=1)
_Guidance = Field(None, ge=0, le=1000, allow_inf_nan=False)
_Seed = Field(None, ge=0, le=MAX_SEED)


_Side = Field(None, ge=1, le=MAX_SIDE)


class _Request(BaseModel):
    """Fields shared by every generation endpoint; other fields are kept for
    :func:`pipeline_kwargs` (``extra="allow"``)."""

    model_config = ConfigDict(extra="allow")

    prompt: str = _Prompt
    model: str | None = None
    size: str | None = None
    width: int | None = _Side
    height: int | None = _Side
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    num_inference_steps: int | None = _Steps
    guidance_scale: float | None = _Guidance
    seed: int | None = _Seed
    flow_shift: float | None = _Guidance
    boundary_ratio: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    extra_params: dict[str, Any] | None = None
    stream: bool | None = None
    user: str | None = None

    @field_validator("size")
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        return _check_size(value)

    @field_validator("stream")
    @classmethod
    def _stream(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("streaming is not supported by this server; omit 'stream' or send "
                             "false")
        return value

    @model_validator(mode="after")
    def _size_agrees(self) -> "_Request":
        if self.size is not None and (self.width is not None or self.height is not None):
            width, height = parse_size(self.size)
            if (self.width or width, self.height or height) != (width, height):
                raise ValueError(
                    f"'size' {self.size!r} disagrees with width={self.width} and "
                    f"height={self.height}; give size or width and height")
        return self

    @property
    def dimensions(self) -> tuple[int | None, int | None] | None:
        """``(width, height)`` of ``size`` or ``width``/``height`` (a side not given is
        None), or None when neither is given (the pipeline's default)."""
        if self.size:
            return parse_size(self.size)
        if self.width is None and self.height is None:
            return None
        return self.width, self.height

    @property
    def size_field(self) -> str:
        """The field that gave the size, for messages: ``size``, ``width`` or ``height``."""
        if self.size is None and self.width is None and self.height is not None:
            return "height"
        return "width" if self.size is None and self.width is not None else "size"


class ImageGenerationRequest(_Request):
    """Body of ``POST /v1/images/generations`` (OpenAI's fields plus sampling knobs).

    ``size`` ``"auto"`` or absent takes the pipeline's default; ``quality``, ``style``,
    ``moderation``, ``safety_identifier``, ``user`` and ``partial_images: 0`` are
    accepted and ignored; ``output_format`` and ``output_compression`` choose the
    encoding; ``seed`` absent picks a random one; image ``i`` of ``n`` uses ``seed + i``.
    """

    n: int | None = Field(None, ge=1, le=10)
    response_format: Literal["b64_json", "url", "file"] | None = None
    quality: Literal["auto", "standard", "hd", "low", "medium", "high"] | None = None
    style: Literal["vivid", "natural"] | None = None
    moderation: Literal["auto", "low"] | None = None
    safety_identifier: str | None = Field(None, max_length=256)
    background: Literal["auto", "opaque", "transparent"] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: int | None = Field(None, ge=0, le=100)
    partial_images: int | None = Field(None, ge=0, le=3)

    @field_validator("background")
    @classmethod
    def _background(cls, value: str | None) -> str | None:
        if value == "transparent":
            raise ValueError("this model makes opaque images; use 'auto' or 'opaque'")
        return value

    @field_validator("partial_images")
    @classmethod
    def _partial(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("partial images need streaming, which this server does not "
                             "support; omit it or send 0")
        return value

    @model_validator(mode="after")
    def _file_is_one(self) -> "ImageGenerationRequest":
        if self.response_format == "file" and (self.n or 1) > 1:
            raise ValueError("response_format 'file' returns one image; use n=1 or b64_json")
        return self


MAX_SECONDS = 3600.0


class VideoGenerationRequest(_Request):
    """Body of ``POST /v1/videos`` (JSON, multipart or url-encoded form).

    ``seconds`` is OpenAI's duration (a string such as ``"4"``, or a number): converted to
    frames at ``fps`` and rounded to a count the model accepts, and echoed as given (the
    number's text). Give it or ``num_frames``, not both.
    """

    seconds: str | float | int | None = None
    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1, le=240)
    guidance_scale_2: float | None = _Guidance

    @field_validator("seconds")
    @classmethod
    def _seconds(cls, value: str | float | int | None) -> str | None:
        if value is None:
            return None
        try:
            if isinstance(value, bool):
                raise ValueError
            seconds = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"seconds must be a number of seconds such as '4', got {value!r}") from None
        if not 0 < seconds <= MAX_SECONDS:
            raise ValueError(f"seconds must be > 0 and at most {MAX_SECONDS:g}, got {value!r}")
        return value.strip() if isinstance(value, str) else f"{value:g}"

    @property
    def duration(self) -> float | None:
        """``seconds`` as a number, or None."""
        return None if self.seconds is None else float(self.seconds)

    @model_validator(mode="after")
    def _one_length(self) -> "VideoGenerationRequest":
        if self.seconds is not None and self.num_frames is not None:
            raise ValueError("give 'seconds' or 'num_frames', not both")
        return self


def pipeline_kwargs(req: _Request, limits: "Limits", text: bool = False) -> dict[str, Any]:
    """The request's pipeline knobs: its fields beyond its own, and ``extra_params``.

    Each is an argument of the served pipeline's ``__call__`` (``limits.knobs``),
    checked by ``engine.knobs.check_knob``; ``null`` is not given; a list has at most
    ``--max-steps + 1`` items, and every steps knob (``prior_num_inference_steps``...,
    ``engine.knobs.is_steps_knob``) is at most ``--max-steps``.

    Args:
        req: the validated request.
        limits: the server's limits, with the model's knob table.
        text: the values come from a form (text, parsed to each knob's type).

    Raises:
        APIError: 400 naming the field: not an argument of this model (the message
            lists the fields it takes), one the server sets, given twice, or a bad value.
    """
    own = set(type(req).model_fields)
    nested = req.extra_params or {}
    values = [(name, value, name) for name, value in (req.model_extra or {}).items()]
    values += [(name, value, f"extra_params.{name}") for name, value in nested.items()]
    knobs = limits.knobs or {}
    out: dict[str, Any] = {}
    for name, value, where in values:
        if value is None:
            continue
        try:
            if name in limits.refused:
                raise refusal(where, limits.refused[name])
            if name in out:
                raise KnobError(where, f"Invalid request: '{name}' is given twice, at the top "
                                       "level and in extra_params.")
            if name in own:
                raise KnobError(where, f"Invalid request: give '{name}' as a field of the "
                                       "request, not in extra_params.")
            if name not in knobs:
                taken = sorted((own - {"extra_params"}) | set(knobs))
                raise KnobError(where, f"Unrecognized request argument supplied: '{where}'. "
                                       f"This model takes: {', '.join(taken)}.")
            out[name] = check_knob(knobs[name], value, field=where, text=text,
                                   max_items=limits.max_steps + 1, max_steps=limits.max_steps)
        except KnobError as exc:
            code = "unknown_parameter" if str(exc).startswith("Unrecognized") else "invalid_value"
            raise APIError(400, str(exc), param=exc.field, code=code) from None
    return out


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 ``APIError`` whose ``param`` names the field."""
    err = exc.errors(include_url=False)[0]
    loc = err.get("loc") or ()
    param = str(loc[0]) if loc else None
    kind = err["type"]
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(
            400, f"We could not parse the JSON body of your request: {msg}", code="invalid_json"
        )
    if param is None and kind == "value_error":
        return APIError(400, f"Invalid request: {msg}.", code="invalid_value")
    if param is None:
        return APIError(400, "The request body must be a JSON object.", code="invalid_body")
    if kind == "missing":
        return APIError(
            400,
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    if kind == "extra_forbidden":
        return APIError(
            400,
            f"Unrecognized request argument supplied: '{param}'.",
            param=param,
            code="unknown_parameter",
        )
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return APIError(
            400, f"Invalid type for '{param}': {msg}.", param=param, code="invalid_type"
        )
    return APIError(400, f"Invalid value for '{param}': {msg}.", param=param, code="invalid_value")


@dataclass(frozen=True)
class Limits:
    """Server limits and the pipeline's size rules.

    Attributes:
        max_pixels: largest ``width * height``.
        max_frames: most frames per video.
        max_steps: most denoising steps.
        size_multiple: width and height must be multiples of this.
        frame_step: ``num_frames - 1`` must be a multiple of this (video pipelines), or None.
        call_params: keyword arguments the pipeline's ``__call__`` takes, or None (unknown).
        model_side: largest width and height the model's config allows, or None.
        model_frames: most frames the model's config allows, or None.
        model_source: where the two come from (``"its transformer's rope_max_seq_len of 32"``).
        knobs: the pipeline's knobs (``engine.knobs.knob_table``), or None (unknown: every
            field beyond a request's own is refused).
        refused: ``__call__`` arguments a request cannot set, with the reason.
    """

    max_pixels: int
    max_frames: int
    max_steps: int
    size_multiple: int = 16
    frame_step: int | None = None
    call_params: frozenset[str] | None = None
    model_side: int | None = None
    model_frames: int | None = None
    model_source: str = ""
    knobs: Mapping[str, Knob] | None = None
    refused: Mapping[str, str] = field(default_factory=dict)


def _over(field: str, value: int, text: str, limit: int, flag: str, given: bool) -> APIError:
    if given:
        message = (f"Invalid value for '{field}': {text} is over this server's limit of {limit} "
                   f"({flag}).")
    else:
        message = (f"Invalid request: '{field}' was omitted and the model's default ({text}) is "
                   f"over this server's limit of {limit} ({flag}); give a smaller '{field}'.")
    return APIError(400, message, param=field, code="invalid_value")


def check_limits(
    req: ImageGenerationRequest | VideoGenerationRequest,
    limits: Limits,
    values: dict[str, Any] | None = None,
) -> None:
    """Server limits and pipeline support of the resolved request.

    Args:
        req: the validated request (which fields were given, and the pipeline knobs).
        limits: the server's limits and the model's size rules.
        values: the resolved ``width``, ``height``, ``num_frames`` and
            ``num_inference_steps`` (an omitted field already replaced by the server's
            default); None: only the fields given are checked.

    Raises:
        APIError: 400 naming the field (and saying when the value is a default).
    """
    if values is None:
        width, height = req.dimensions or (None, None)
        values = {"width": width, "height": height,
                  "num_inference_steps": req.num_inference_steps,
                  "num_frames": getattr(req, "num_frames", None)}
    width, height = values.get("width"), values.get("height")
    size_given = req.dimensions is not None
    size_field = req.size_field
    given = {name for name in req.model_fields_set if getattr(req, name, None) is not None}
    if width is not None and height is not None:
        if width * height > limits.max_pixels:
            raise _over(size_field, width * height, f"{width}x{height} = {width * height} pixels",
                        limits.max_pixels, "--max-pixels", size_given)
        m = limits.size_multiple
        if width % m or height % m:
            raise APIError(
                400,
                f"Invalid value for '{size_field}': width and height must be multiples of {m} for "
                f"this model (its VAE scale factor times its patch size), got {width}x{height}.",
                param=size_field,
                code="invalid_value",
            )
        side = limits.model_side
        if side is not None and (width > side or height > side):
            raise APIError(
                400,
                f"Invalid value for '{size_field}': {width}x{height} is more than this model "
                f"can generate: {limits.model_source} allows at most {side} pixels a side"
                f"{'' if size_given else ' (the model default)'}.",
                param=size_field,
                code="invalid_value",
            )
    steps = values.get("num_inference_steps")
    if steps is not None and steps > limits.max_steps:
        raise _over("num_inference_steps", steps, str(steps), limits.max_steps, "--max-steps",
                    "num_inference_steps" in given)
    frames = values.get("num_frames")
    if frames is not None:
        field = "seconds" if "seconds" in given else "num_frames"
        text = (f"{frames} frames" if field == "seconds" else str(frames))
        if frames > limits.max_frames:
            raise _over(field, frames, text, limits.max_frames, "--max-frames",
                        field in given)
        if limits.model_frames is not None and frames > limits.model_frames:
            raise APIError(
                400,
                f"Invalid value for '{field}': {text} is more than this model can generate: "
                f"{limits.model_source} allows at most {limits.model_frames} frames.",
                param=field,
                code="invalid_value",
            )
        if limits.frame_step and (frames - 1) % limits.frame_step:
            raise APIError(
                400,
                f"Invalid value for 'num_frames': this model needs num_frames - 1 to be a "
                f"multiple of {limits.frame_step} (e.g. {limits.frame_step + 1}, "
                f"{2 * limits.frame_step + 1}), got {frames}.",
                param="num_frames",
                code="invalid_value",
            )
    if limits.call_params is not None:
        for name in ("negative_prompt", "guidance_scale", "guidance_scale_2"):
            if getattr(req, name, None) is not None and name not in limits.call_params:
                raise APIError(
                    400,
                    f"Unsupported parameter '{name}': this model's pipeline does not take it.",
                    param=name,
                    code="unsupported_parameter",
                )


def form_to_dict(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """Form fields as a dict for lax validation.

    Raises:
        APIError: a file upload or a repeated field (400 naming it).
    """
    out: dict[str, Any] = {}
    for key, value in items:
        if not isinstance(value, str):
            raise APIError(
                400,
                f"Invalid type for '{key}': file uploads are not supported.",
                param=key,
                code="invalid_type",
            )
        if key in out:
            raise APIError(
                400,
                f"Invalid value for '{key}': the field is given more than once.",
                param=key,
                code="invalid_value",
            )
        out[key] = value
    return out
