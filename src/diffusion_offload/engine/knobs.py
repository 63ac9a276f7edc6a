"""Pipeline knobs: the ``__call__`` arguments a request may set by name, typed and bounded.

A knob is a keyword argument of the served pipeline's ``__call__`` whose value JSON can
carry: a number, a bool, a string, or a list of numbers. Its type comes from the
signature's annotation (``float``, ``Optional[int]``, ``Union[str, List[str]]``, ...) or,
without one, from its default. What the engine sets itself (``generator``,
``output_type``, callbacks, ``num_images_per_prompt``...) and what JSON cannot carry
(tensors such as ``latents`` and ``prompt_embeds``, images, dicts) are refused by name.

Used by ``serve`` (request fields and ``extra_params``) and ``generate --param``: both
check values with :func:`check_knob`, so the rules are one.
"""

from __future__ import annotations

import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_TRUE_CFG_SCALE", "ENGINE_SET", "MAX_FLOAT", "MAX_INT", "MAX_STRING", "STEP_WORDS",
    "Knob", "KnobError", "check_knob", "is_steps_knob", "knob_table", "refusal",
]

MAX_FLOAT = 1000.0
"""Largest float knob (guidance scales, shifts): values are finite, 0 to this."""
MAX_INT = 4096
"""Largest int knob (``max_sequence_length``, ``clip_skip``...): 0 to this."""
MAX_STRING = 32_000
"""Longest string knob, in characters (``prompt_2``: a prompt, as OpenAI allows)."""
UNIT_INTERVAL = frozenset({"strength", "boundary_ratio", "eta"})
"""Knobs that are fractions: 0 to 1."""
STEP_WORDS = frozenset({"step", "steps", "iter", "iters", "iterations"})
"""An integer knob with one of these words in its name (split at ``_``) counts denoising
steps or iterations (``prior_num_inference_steps`` of Stable Cascade and the Kandinsky
combined pipelines, ``decoder_num_inference_steps``, ``original_inference_steps``,
``max_iter_to_alter``...): it obeys the server's ``--max-steps`` like
``num_inference_steps``."""

DEFAULT_TRUE_CFG_SCALE = 4.0
"""``true_cfg_scale`` given to a pipeline whose negative prompt needs ``true_cfg_scale > 1``
(FLUX, Qwen-Image) when a request has a negative prompt and leaves it unset."""

ENGINE_SET: Mapping[str, str] = {
    "output_type": "the server returns images or videos it encodes itself",
    "return_dict": "the engine reads the pipeline's output object",
    "generator": "set from 'seed'",
    "num_images_per_prompt": "use 'n'",
    "num_videos_per_prompt": "use 'n'",
    "callback": "callbacks cannot be sent in a request",
    "callback_steps": "callbacks cannot be sent in a request",
    "callback_on_step_end": "callbacks cannot be sent in a request",
    "callback_on_step_end_tensor_inputs": "callbacks cannot be sent in a request",
    "prompt": "the request's prompt",
}
"""``__call__`` arguments the engine sets itself, with the reason a request cannot."""

_JSON_TYPES = {float: "float", int: "int", bool: "bool", str: "str"}


class KnobError(ValueError):
    """A knob value refused; ``field`` names it (for the 400's ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Knob:
    """One ``__call__`` argument a request may set.

    Attributes:
        name: the argument's name.
        kind: ``"float"``, ``"int"``, ``"bool"`` or ``"str"``: the value's (or each
            item's) type.
        is_list: the value is a list of ``kind`` (``sigmas``, ``timesteps``).
        default: the signature's default (None when it has none or it is not JSON).
    """

    name: str
    kind: str
    is_list: bool = False
    default: Any = None

    @property
    def type_text(self) -> str:
        """The type as a message says it: ``"a number"``, ``"a list of numbers"``."""
        word = {"float": "number", "int": "integer", "bool": "boolean", "str": "string"}[self.kind]
        return f"a list of {word}s" if self.is_list else f"{'an' if word[0] in 'ai' else 'a'} {word}"


def is_steps_knob(knob: Knob) -> bool:
    """Whether ``knob`` counts steps (:data:`STEP_WORDS`): an integer, or a list of
    integers, whose name has a step word."""
    return knob.kind == "int" and bool(STEP_WORDS & set(knob.name.lower().split("_")))


def _members(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return [m for a in typing.get_args(annotation) for m in _members(a)]
    return [annotation]


def _knob_of(name: str, annotation: Any, default: Any) -> Knob | str:
    """The knob, or the reason it cannot be a request field."""
    json_default = default if isinstance(default, (int, float, str, bool)) else None
    if annotation is inspect.Parameter.empty:
        if isinstance(default, bool):
            return Knob(name, "bool", default=default)
        for py, kind in _JSON_TYPES.items():
            if type(default) is py:
                return Knob(name, kind, default=default)
        return "its value is not a number, boolean or string"
    members = [m for m in _members(annotation) if m is not type(None)]
    scalars = [m for m in members if m in _JSON_TYPES]
    lists = [typing.get_args(m)[0] for m in members
             if typing.get_origin(m) in (list, typing.List) and typing.get_args(m)  # noqa: UP006
             and typing.get_args(m)[0] in _JSON_TYPES]
    if len(scalars) + len(lists) != len(members) or not members:
        return "its value is a tensor, an image or an object, which JSON cannot carry"
    if scalars:  # Union[str, List[str]]: one request is one prompt, so the scalar form
        kinds = {_JSON_TYPES[m] for m in scalars}
        kind = "float" if kinds <= {"float", "int"} and "float" in kinds else sorted(kinds)[0]
        return Knob(name, kind, default=json_default)
    return Knob(name, _JSON_TYPES[lists[0]], is_list=True)


def knob_table(call: Callable[..., Any]) -> tuple[dict[str, Knob], dict[str, str]]:
    """``(knobs, refused)`` of a pipeline's ``__call__``.

    Args:
        call: the pipeline's ``__call__`` (bound or not).

    Returns:
        ``knobs``: name -> :class:`Knob` for every argument JSON can carry; ``refused``:
        name -> the reason for every other named argument (engine-set ones from
        :data:`ENGINE_SET`, tensors and objects). ``self`` and ``**kwargs`` are left out.
    """
    try:
        hints = typing.get_type_hints(call)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: read it raw
        hints = {}
    knobs: dict[str, Knob] = {}
    refused: dict[str, str] = {}
    for name, param in inspect.signature(call).parameters.items():
        if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name in ENGINE_SET:
            refused[name] = ENGINE_SET[name]
            continue
        found = _knob_of(name, hints.get(name, param.annotation), param.default)
        if isinstance(found, Knob):
            knobs[name] = found
        else:
            refused[name] = found
    return knobs, refused


def refusal(field: str, reason: str) -> KnobError:
    """The error for a request that sets the refused argument ``field``."""
    return KnobError(field, f"'{field}' cannot be set by a request: {reason}.")


def _parse_text(knob: Knob, text: str) -> Any:
    """A form value (text) as the knob's type; lists as JSON text (``"[1.0, 0.5]"``)."""
    if knob.is_list:
        try:
            return json.loads(text)
        except ValueError:
            return text
    if knob.kind == "bool":
        lowered = text.strip().lower()
        return {"true": True, "1": True, "false": False, "0": False}.get(lowered, text)
    if knob.kind in ("int", "float"):
        try:
            return int(text) if knob.kind == "int" else float(text)
        except ValueError:
            return text
    return text


def _check_item(knob: Knob, field: str, value: Any, max_steps: int | None = None) -> Any:
    kind = knob.kind
    if kind == "bool":
        if not isinstance(value, bool):
            raise KnobError(field, f"Invalid type for '{field}': expected a boolean, got {value!r}.")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise KnobError(field, f"Invalid type for '{field}': expected a string, got {value!r}.")
        if len(value) > MAX_STRING:
            raise KnobError(field, f"Invalid value for '{field}': at most {MAX_STRING} characters, "
                                   f"got {len(value)}.")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind == "int" and not isinstance(value, int)):
        word = "an integer" if kind == "int" else "a number"
        raise KnobError(field, f"Invalid type for '{field}': expected {word}, got {value!r}.")
    top = 1.0 if knob.name in UNIT_INTERVAL else (MAX_INT if kind == "int" else MAX_FLOAT)
    if max_steps is not None and is_steps_knob(knob) and value > max_steps:
        raise KnobError(field, f"Invalid value for '{field}': {value} is over this server's limit "
                               f"of {max_steps} (--max-steps).")
    if not math.isfinite(value) or not 0 <= value <= top:
        raise KnobError(field, f"Invalid value for '{field}': must be from 0 to {top:g}, got {value!r}.")
    return float(value) if kind == "float" else value


def check_knob(knob: Knob, value: Any, *, field: str | None = None, text: bool = False,
               max_items: int = 101, max_steps: int | None = None) -> Any:
    """``value`` checked (and, from text, parsed) as ``knob`` takes it.

    Args:
        knob: the argument.
        value: the value (JSON-decoded, or a string when ``text``).
        field: the name to put in messages (default ``knob.name``; ``"extra_params.x"``).
        text: ``value`` is a form field or a ``--param`` value: parsed to the knob's type
            first (``"4"`` -> 4.0; lists as JSON text).
        max_items: the most items of a list value (``sigmas``: the steps, so the server
            passes ``--max-steps + 1``).
        max_steps: the most a steps knob (:func:`is_steps_knob`) may be, each item of a
            list of them, and the sum of a list of inference steps
            (``pyramid_num_inference_steps_list``): the server's ``--max-steps``; None
            leaves them at :data:`MAX_INT`.

    Returns:
        The value for ``__call__`` (ints given for a float knob become floats).

    Raises:
        KnobError: the wrong type, out of range, a steps knob over ``max_steps``, or a
            list over ``max_items`` (the message names the field, the value and what is
            allowed).
    """
    field = field or knob.name
    if text and isinstance(value, str):
        value = _parse_text(knob, value)
    if knob.is_list:
        if not isinstance(value, list):
            raise KnobError(field, f"Invalid type for '{field}': expected {knob.type_text}, got {value!r}.")
        if not 1 <= len(value) <= max_items:
            raise KnobError(field, f"Invalid value for '{field}': a list of 1 to {max_items} items, "
                                   f"got {len(value)}.")
        items = [_check_item(knob, field, item, max_steps) for item in value]
        if max_steps is not None and is_steps_knob(knob) and "inference" in knob.name \
                and sum(items) > max_steps:
            raise KnobError(field, f"Invalid value for '{field}': its steps add up to {sum(items)}, "
                                   f"over this server's limit of {max_steps} (--max-steps).")
        return items
    return _check_item(knob, field, value, max_steps)
