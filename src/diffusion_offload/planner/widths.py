"""Stored weight widths: what a component holds when its weights are quantized.

A quantizer (torchao, optimum-quanto, bitsandbytes, fp8 storage) stores the weights of a
component's ``nn.Linear`` layers at a narrower width and keeps the rest (biases, norms,
embeddings, convolutions) at the load dtype. The planner sizes such a component at its
stored width (``stored_delta``), from one of:

* ``--weights-dtype`` (``parse_weights_dtype``): "I will quantize at load", for every DiT
  and encoder (``fp8``) or per role or component name (``dit=fp8,text_encoder=bf16``);
* the ``quantization_config`` in the component's ``config.json`` (``config_width``), as
  diffusers and transformers write it for a model quantized at load (bitsandbytes
  ``load_in_4bit`` / ``load_in_8bit``, torchao ``quant_type``, quanto ``weights_dtype``).

A pre-quantized checkpoint needs neither: its safetensors headers already give the stored
dtypes (``F8_E4M3``, ``I8``, ``U8``...), which the planner counts as they are; only
weights stored as floats are narrowed.

Bytes per weight element, scales included (``WIDTHS``): ``fp8`` and ``int8`` store one
byte per element plus one float32 scale per output row (torchao's and quanto's per-row
weight-only scales; torchao's int8 also one int8 zero point per row); ``nf4`` half a byte
plus one absmax byte per 64-element block (bitsandbytes' default nested statistics) and
its code tables; ``int4`` half a byte plus a bfloat16 scale and zero point per group of
128; ``bf16`` / ``fp16`` / ``fp32`` a plain cast.

Sources: torchao 0.18 ``Int8Tensor`` / ``Float8Tensor`` (``qdata`` + per-row ``scale``),
optimum-quanto 0.2.7 ``WeightQBytesTensor`` (``_data`` + ``_scale``), bitsandbytes 0.50
``Params4bit`` (``blocksize=64``, ``compress_statistics=True``), diffusers 0.42
``quantizers/quantization_config.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["WIDTHS", "config_width", "parse_weights_dtype", "stored_delta", "width_for"]

#: width name -> (bytes per weight element, bytes per output row, bytes per group, group)
WIDTHS: dict[str, tuple[float, int, int, int]] = {
    "fp32": (4.0, 0, 0, 0),
    "bf16": (2.0, 0, 0, 0),
    "fp16": (2.0, 0, 0, 0),
    "fp8": (1.0, 4, 0, 0),
    "int8": (1.0, 5, 0, 0),
    "nf4": (0.5, 0, 1, 64),
    "int4": (0.5, 0, 4, 128),
}

_ROLES = ("dit", "text_encoder", "encoder", "vae")
_DEFAULT_ROLES = ("dit", "text_encoder", "encoder")


def parse_weights_dtype(text: str | Mapping[str, str] | None) -> dict[str, str]:
    """Parse ``--weights-dtype``: ``fp8`` (every DiT and encoder) or ``key=width,...``,
    each key a role (``dit``, ``text_encoder``, ``encoder``, ``vae``) or a component name.

    Returns:
        key -> width name (``WIDTHS``); ``{}`` for None or ``""``.

    Raises:
        ValueError: an unknown width, an empty key, or a key given twice (named, with
            what is allowed).
    """
    if not text:
        return {}
    items = dict(text) if isinstance(text, Mapping) else None
    if items is None:
        parts = [p.strip() for p in str(text).split(",") if p.strip()]
        if len(parts) == 1 and "=" not in parts[0]:
            items = {role: parts[0] for role in _DEFAULT_ROLES}
        else:
            items = {}
            for part in parts:
                key, sep, value = (s.strip() for s in part.partition("="))
                if not sep or not key:
                    raise ValueError(
                        f"weights_dtype entry {part!r} is not allowed: give one width for every "
                        f"DiT and encoder (e.g. fp8) or key=width entries (e.g. dit=fp8,"
                        f"text_encoder=bf16), keys a role {list(_ROLES)} or a component name"
                    )
                if key in items:
                    raise ValueError(f"weights_dtype names {key!r} twice ({text!r}); give each key once")
                items[key] = value
    for key, value in items.items():
        if value not in WIDTHS:
            raise ValueError(
                f"weights_dtype {key}={value!r} is not allowed; allowed widths: {list(WIDTHS)}"
            )
    return items


def width_for(spec: Mapping[str, str], name: str, role: str) -> str | None:
    """The width ``spec`` (``parse_weights_dtype``) gives component ``name`` of ``role``:
    its name's entry, else its role's, else None."""
    return spec.get(name) or spec.get(role)


def config_width(config: Mapping[str, Any] | None) -> str | None:
    """The width a component's ``quantization_config`` (from its ``config.json``) stores
    its Linear weights at, or None (no or unknown quantization)."""
    q = (config or {}).get("quantization_config")
    if not isinstance(q, Mapping):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "bitsandbytes":
        if q.get("load_in_4bit"):
            return "nf4"
        return "int8" if q.get("load_in_8bit") else None
    if method == "torchao":
        kind = str(q.get("quant_type", "")).lower()
        kind = kind if kind else str(q.get("quant_type_kwargs", "")).lower()
        for token, width in (("float8", "fp8"), ("fp8", "fp8"), ("int8", "int8"), ("int4", "int4")):
            if token in kind:
                return width
        return None
    if method == "quanto":
        weights = str(q.get("weights_dtype", q.get("weights", ""))).lower()
        return {"float8": "fp8", "int8": "int8", "int4": "int4"}.get(weights)
    return None


def _stored(numel: int, rows: int, width: str) -> int:
    per, per_row, per_group, group = WIDTHS[width]
    groups = -(-numel // group) if group else 0
    return int(numel * per) + rows * per_row + groups * per_group


def stored_delta(module: nn.Module, width: str, floating: Mapping[str, bool] | None = None) -> int:
    """Bytes that storing ``module``'s ``nn.Linear`` weights at ``width`` adds (negative:
    saves) against their bytes in ``module`` (built at the load dtype).

    Args:
        module: the component or block, on the meta device.
        width: a ``WIDTHS`` name.
        floating: per parameter name (``module``-relative), whether the checkpoint stores
            it as a float; a weight it stores narrower already is left as it is. None:
            every weight is a float (a weightless config).
    """
    delta = 0
    for prefix, sub in module.named_modules():
        if not isinstance(sub, nn.Linear):
            continue
        w = sub.weight
        if w is None or not w.dtype.is_floating_point:
            continue
        key = f"{prefix}.weight" if prefix else "weight"
        if floating is not None and not floating.get(key, True):
            continue
        now = w.numel() * w.element_size()
        delta += _stored(w.numel(), w.shape[0], width) - now
    return delta
