"""Request models of the HTTP API and their validation into OpenAI-style 400 errors.

JSON bodies are validated strictly (``"n": "2"`` is a type error); multipart and
url-encoded forms, whose values are all text, in lax mode (``"2"`` becomes 2). Unknown
fields are rejected (``extra="forbid"``), so a typo never silently does nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import APIError

__all__ = [
    "ImageGenerationRequest",
    "Limits",
    "VideoGenerationRequest",
    "check_limits",
    "form_to_dict",
    "parse_size",
    "validation_error",
]

MAX_PROMPT_CHARS = 10_000
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


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @field_validator("size", check_fields=False)
    @classmethod
    def _size(cls, value: str | None) -> str | None:
        return _check_size(value)

    @property
    def dimensions(self) -> tuple[int, int] | None:
        """``(width, height)`` of ``size``, or None for the pipeline's default."""
        size = getattr(self, "size", None)
        return parse_size(size) if size else None


class ImageGenerationRequest(_Request):
    """Body of ``POST /v1/images/generations`` (OpenAI's fields plus sampling knobs).

    ``size`` ``"auto"`` or absent takes the pipeline's default; ``user`` is accepted and
    ignored; ``seed`` absent picks a random one; image ``i`` of ``n`` uses ``seed + i``.
    """

    prompt: str = _Prompt
    model: str | None = None
    n: int | None = Field(None, ge=1, le=10)
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = None
    user: str | None = None
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    num_inference_steps: int | None = _Steps
    guidance_scale: float | None = _Guidance
    seed: int | None = _Seed


MAX_SECONDS = 3600.0


class VideoGenerationRequest(_Request):
    """Body of ``POST /v1/videos`` (JSON or multipart form).

    ``seconds`` is OpenAI's duration (a string such as ``"4"``, or a number): converted to
    frames at ``fps`` and rounded to a count the model accepts. Give it or
    ``num_frames``, not both.
    """

    prompt: str = _Prompt
    model: str | None = None
    negative_prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    size: str | None = None
    seconds: str | float | int | None = None
    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1, le=240)
    num_inference_steps: int | None = _Steps
    guidance_scale: float | None = _Guidance
    guidance_scale_2: float | None = _Guidance
    seed: int | None = _Seed


    @field_validator("seconds")
    @classmethod
    def _seconds(cls, value: str | float | int | None) -> float | None:
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
        return seconds

    @model_validator(mode="after")
    def _one_length(self) -> "VideoGenerationRequest":
        if self.seconds is not None and self.num_frames is not None:
            raise ValueError("give 'seconds' or 'num_frames', not both")
        return self


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
    given = req.model_fields_set
    width, height = values.get("width"), values.get("height")
    size_given = "size" in given and req.dimensions is not None
    if width is not None and height is not None:
        if width * height > limits.max_pixels:
            raise _over("size", width * height, f"{width}x{height} = {width * height} pixels",
                        limits.max_pixels, "--max-pixels", size_given)
        m = limits.size_multiple
        if width % m or height % m:
            raise APIError(
                400,
                f"Invalid value for 'size': width and height must be multiples of {m} for this "
                f"model (its VAE scale factor times its patch size), got {width}x{height}.",
                param="size",
                code="invalid_value",
            )
        side = limits.model_side
        if side is not None and (width > side or height > side):
            raise APIError(
                400,
                f"Invalid value for 'size': {width}x{height} is more than this model can "
                f"generate: {limits.model_source} allows at most {side} pixels a side"
                f"{'' if size_given else ' (the model default)'}.",
                param="size",
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
