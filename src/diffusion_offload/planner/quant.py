"""Weight formats for planning: what a component weighs when it is quantized or cast.

The planner sizes a component at its stored width. A pre-quantized checkpoint's
safetensors headers already give it (``I8``, ``U8``, ``F8_E4M3`` count at their width:
``planner.model``). A component quantized at load is sized here, from a format named
either by its ``config.json``'s ``quantization_config`` (``format_from_quantization_config``)
or by the user (``plan --weights-dtype``, ``parse_weights_dtype``).

A quantizing format (``fp8``, ``int8``, ``nf4``, ``int4``) replaces the weight of every
``nn.Linear`` (what torchao's weight-only configs, optimum-quanto's ``quantize`` and
bitsandbytes' ``Linear4bit``/``Linear8bitLt`` replace) by its quantized data plus its
scales; biases, norms, embeddings and convolutions keep the load dtype. A casting format
(``bf16``, ``fp16``, ``fp32``) gives every floating tensor that dtype (the tensors a
library keeps in float32 stay there, as at load).

Bytes per weight element and per scale (sources): torchao's ``Float8WeightOnlyConfig``
(1 byte, one float32 scale per output row) and ``Int8WeightOnlyConfig`` (1 byte, one scale
per output row at the load dtype); bitsandbytes NF4 (4 bits, one float32 absmax per block
of 64, ``Params4bit`` with ``blocksize=64``; without double quantisation, the upper bound)
and ``Int8Params`` (1 byte, one float32 ``SCB`` per row); torchao's int4 weight-only
(4 bits, a scale and a zero point at the load dtype per group of 128).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "FORMATS",
    "WeightFormat",
    "format_from_quantization_config",
    "format_delta",
    "parse_weights_dtype",
    "weights_format_for",
]


@dataclass(frozen=True)
class WeightFormat:
    """How one format stores a weight.

    Attributes:
        name: the name users give (``"fp8"``).
        bits: bits per weight element (quantizing formats; 0 for casting ones).
        row_scale: bytes of scales per output row of a Linear weight (a multiple of the
            load dtype's size when ``scale_at_load_dtype``).
        group: elements per group of ``group_scale`` bytes (0: no groups).
        group_scale: bytes of scales per group.
        scale_at_load_dtype: ``row_scale`` and ``group_scale`` count elements of the load
            dtype (their value is then that many elements).
        cast: the dtype every floating tensor gets (casting formats), else None.
    """

    name: str
    bits: int = 0
    row_scale: int = 0
    group: int = 0
    group_scale: int = 0
    scale_at_load_dtype: bool = False
    cast: torch.dtype | None = None

    @property
    def quantizes(self) -> bool:
        return self.cast is None


FORMATS: dict[str, WeightFormat] = {
    "fp8": WeightFormat("fp8", bits=8, row_scale=4),
    "int8": WeightFormat("int8", bits=8, row_scale=1, scale_at_load_dtype=True),
    "nf4": WeightFormat("nf4", bits=4, group=64, group_scale=4),
    "int4": WeightFormat("int4", bits=4, group=128, group_scale=2, scale_at_load_dtype=True),
    "bf16": WeightFormat("bf16", cast=torch.bfloat16),
    "fp16": WeightFormat("fp16", cast=torch.float16),
    "fp32": WeightFormat("fp32", cast=torch.float32),
}
"""The formats ``--weights-dtype`` takes, by name."""

_ALIASES = {
    "float8": "fp8", "float8_e4m3fn": "fp8", "qfloat8": "fp8", "qint8": "int8", "int8_weight_only": "int8",
    "float8_weight_only": "fp8", "int4_weight_only": "int4", "qint4": "int4", "bfloat16": "bf16",
    "float16": "fp16", "float32": "fp32",
}
_ROLES = ("dit", "text_encoder")


def _format(name: str, where: str) -> WeightFormat:
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in FORMATS:
        raise ValueError(f"{where}: weights format {name!r} is not allowed; allowed: {sorted(FORMATS)}")
    return FORMATS[key]


def parse_weights_dtype(spec: str | Mapping[str, str] | None) -> dict[str, WeightFormat]:
    """Parse ``--weights-dtype``: one format for every DiT and text encoder (``"fp8"``), or
    ``KEY=FORMAT`` pairs separated by commas, a key being a role (``dit``,
    ``text_encoder``) or a component name (``transformer_2``); a mapping is taken as the
    pairs. Returns ``{key: format}`` (a bare format is ``{"dit": f, "text_encoder": f}``).

    Raises:
        ValueError: an empty key or pair, a key given twice, or an unknown format (the
            message names it and lists the formats).
    """
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        pairs = [(str(k), str(v)) for k, v in spec.items()]
    else:
        text = str(spec).strip()
        if not text:
            raise ValueError("--weights-dtype is empty; give a format, e.g. fp8, or dit=fp8,text_encoder=bf16")
        if "=" not in text:
            fmt = _format(text, "--weights-dtype")
            return {role: fmt for role in _ROLES}
        pairs = []
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise ValueError(f"--weights-dtype: {part.strip()!r} is not KEY=FORMAT (e.g. dit=fp8)")
            pairs.append((key.strip(), value.strip()))
    out: dict[str, WeightFormat] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"--weights-dtype names {key!r} twice")
        out[key] = _format(value, f"--weights-dtype {key}")
    return out


def weights_format_for(
    formats: Mapping[str, WeightFormat], name: str, role: str
) -> WeightFormat | None:
    """The format of component ``name`` (role ``role``): its own entry, else its role's."""
    return formats.get(name) or formats.get(role)


def format_from_quantization_config(config_text: str | None) -> WeightFormat | None:
    """The format a component's ``config.json`` asks to be quantized to at load
    (``quantization_config``: bitsandbytes ``load_in_4bit``/``load_in_8bit``, torchao
    ``quant_type``, optimum-quanto ``weights``), or None (no such config, or one this
    planner cannot size: it is then sized at the load dtype)."""
    if not config_text:
        return None
    try:
        qc = json.loads(config_text).get("quantization_config")
    except (ValueError, AttributeError):
        return None
    if not isinstance(qc, dict):
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "bitsandbytes":
        if qc.get("load_in_4bit"):
            return FORMATS["nf4"]
        if qc.get("load_in_8bit"):
            return FORMATS["int8"]
        return None
    candidates: list[Any] = []
    if method == "torchao":
        quant_type = qc.get("quant_type")
        candidates = [quant_type.get("default") if isinstance(quant_type, dict) else quant_type]
    elif method == "quanto":
        candidates = [qc.get("weights_dtype"), qc.get("weights")]
    for value in candidates:
        if isinstance(value, dict):  # a serialised torchao config: {"_type": "Int8WeightOnlyConfig", ...}
            value = value.get("_type")
        if not isinstance(value, str):
            continue
        lowered = value.lower()
        for key, fmt in (("float8", "fp8"), ("fp8", "fp8"), ("int8", "int8"), ("int4", "int4"), ("nf4", "nf4")):
            if key in lowered:
                return FORMATS[fmt]
    return None


def _size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def format_delta(module: nn.Module, fmt: WeightFormat, load_dtype: torch.dtype) -> int:
    """Bytes ``module`` (on the meta device, cast as loading at ``load_dtype`` casts it)
    gains (negative: loses) when stored in ``fmt``; each tensor counted once. A cast
    changes the tensors at ``load_dtype`` only (those a library keeps in float32 stay)."""
    seen: set[int] = set()
    delta = 0
    if fmt.cast is not None:
        new = _size(fmt.cast)
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) in seen or t.dtype != load_dtype:
                continue
            seen.add(id(t))
            delta += t.numel() * (new - t.element_size())
        return delta
    for sub in module.modules():
        if not isinstance(sub, nn.Linear):
            continue
        w = sub.weight
        if w is None or id(w) in seen or w.dim() != 2 or not w.is_floating_point():
            continue
        seen.add(id(w))
        rows, numel = w.shape[0], w.numel()
        unit = w.element_size() if fmt.scale_at_load_dtype else 1
        stored = numel * fmt.bits // 8 + rows * fmt.row_scale * unit
        if fmt.group:
            stored += -(-numel // fmt.group) * fmt.group_scale * unit
        delta += stored - numel * w.element_size()
    return delta
