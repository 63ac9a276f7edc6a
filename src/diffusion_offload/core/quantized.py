"""Quantized weights: the plain tensors that carry each weight's bytes.

The mover moves plain tensors (``tensor.data = payload``, ``transfer``). A quantized
weight is carried by one or more plain tensors, found here:

* **Traceable wrapper subclasses** (``__tensor_flatten__`` / ``__tensor_unflatten__``:
  torchao's ``Int8Tensor`` / ``Float8Tensor``, optimum-quanto's ``WeightQBytesTensor``...)
  have no storage of their own; their bytes are the inner tensors ``__tensor_flatten__``
  names (recursively, for nested wrappers). Those inner tensors are what moves, each
  keeping its identity. A wrapper records its device in its own ``TensorImpl``, which
  moving its inner tensors does not change, so once all its inner tensors are on one
  device the wrapper's ``TensorImpl`` is exchanged for one rebuilt through
  ``__tensor_unflatten__`` from those same inner tensors (``refresh``): the Parameter keeps
  its identity, class, attributes (its ``__dict__``) and ``requires_grad``; only its
  device metadata changes, as ``set_data`` does for a plain Parameter.
  (``torch.utils.swap_tensors`` would do the same exchange but refuses tensors with
  weakrefs, which ``torch.compile`` keeps; the exchange here is its ``TensorImpl`` step
  alone, ``torch._C._swap_tensor_impl``.)
* **bitsandbytes** ``Params4bit`` is a Parameter with storage (the packed 4-bit
  weight) whose dequantization state ``quant_state`` (``absmax``, ``code``, ``offset``,
  and with nested statistics ``state2.absmax`` / ``state2.code``) holds plain tensors
  that are neither parameters nor buffers; ``Int8Params`` holds ``CB`` (an alias of its
  own storage) and ``SCB`` (row scales), which ``Linear8bitLt`` moves to its ``state``
  on its first forward. All of them move with their weight.
* Other subclasses with storage of their own whose ``__dict__`` holds no tensor
  (diffusers' ``GGUFParameter``) move as themselves, like plain Parameters; fp8 storage
  (layerwise casting) is plain tensors.

Anything else (a wrapper subclass without ``__tensor_flatten__``, a subclass holding
tensors in attributes this module does not know, a wrapper whose inner tensors are not
plain or that cannot be rebuilt) is refused with ``UnsupportedTensorError``, naming the
tensor's path, its class and ``SUPPORTED``.

A device's own tensor classes (the test accelerator's ``FakeDeviceTensor``, which wraps
a host tensor) set the class attribute ``DEVICE_TENSOR`` to True and count as plain.

Sources: torch ``torch/utils/_python_dispatch.py`` (``is_traceable_wrapper_subclass``,
the flatten/unflatten protocol), ``torch/utils/__init__.py`` (``swap_tensors``); torchao
0.18 ``torchao/utils.py`` (``TorchAOBaseTensor``); optimum-quanto 0.2.7
``optimum/quanto/tensor/weights/qbytes.py``; bitsandbytes 0.50 ``bitsandbytes/nn/
modules.py`` (``Params4bit``, ``Int8Params``, ``Linear8bitLt.init_8bit_state``) and
``bitsandbytes/functional.py`` (``QuantState``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "DEVICE_TENSOR",
    "SUPPORTED",
    "Carrier",
    "UnsupportedTensorError",
    "carriers",
    "module_carriers",
    "check_rebuild",
    "refresh",
]

DEVICE_TENSOR = "__device_tensor__"
"""Class attribute a device's own tensor class sets to True (it then counts as plain)."""

SUPPORTED = (
    "plain tensors and Parameters (any dtype, fp8 included: layerwise casting); traceable "
    "wrapper subclasses whose inner tensors are plain (__tensor_flatten__ / "
    "__tensor_unflatten__: torchao Int8Tensor / Float8Tensor, optimum-quanto "
    "WeightQBytesTensor); bitsandbytes Params4bit (with its quant_state) and Int8Params "
    "(with CB / SCB); Parameter subclasses with storage of their own and no tensor "
    "attributes (diffusers GGUFParameter); DTensor shards"
)
"""The weight formats the mover handles, for error messages."""

_PLAIN = (torch.Tensor, nn.Parameter)


class UnsupportedTensorError(TypeError):
    """A weight whose format the mover cannot move (raised before anything moves)."""


class Carrier:
    """One plain tensor that carries (part of) a weight's bytes.

    Attributes:
        name: its dotted path (``blocks.0.to_q.weight.qdata``, ``...weight.quant_state.absmax``).
        tensor: the plain tensor (it is what moves; its identity never changes).
        outers: the wrapper subclasses it is an inner tensor of, innermost first (empty
            for a plain weight or a bitsandbytes state tensor): refreshed after it moves.
    """

    __slots__ = ("name", "tensor", "outers")

    def __init__(self, name: str, tensor: torch.Tensor, outers: tuple[torch.Tensor, ...] = ()) -> None:
        self.name = name
        self.tensor = tensor
        self.outers = outers


@functools.cache
def _kind(cls: type) -> str:
    """How a tensor of class ``cls`` is carried: ``plain`` (a tensor, a Parameter, a
    DTensor), ``Params4bit`` / ``Int8Params`` (bitsandbytes), ``device`` (a device's own
    class, ``DEVICE_TENSOR``), ``wrapper`` (a traceable wrapper subclass) or ``other``
    (any other subclass: checked per tensor)."""
    if cls in _PLAIN:
        return "plain"
    for c in cls.__mro__:
        if c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed"):
            return "plain"
        if c.__module__.startswith("bitsandbytes") and c.__name__ in ("Params4bit", "Int8Params"):
            return c.__name__
    if getattr(cls, DEVICE_TENSOR, False):
        return "device"
    if hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__"):
        return "wrapper"
    return "other"


def _tensor_attrs(t: torch.Tensor) -> list[str]:
    """Names of the tensors in ``t``'s ``__dict__`` (a device tensor's own: left out)."""
    own: set[str] = set()
    if _kind(type(t)) == "device":
        for c in type(t).__mro__:
            if getattr(c, DEVICE_TENSOR, False) and DEVICE_TENSOR in vars(c):
                own |= set(getattr(c, "__annotations__", {}))
    return [k for k, v in vars(t).items() if isinstance(v, torch.Tensor) and k not in own]


def _refuse(name: str, t: torch.Tensor, why: str) -> UnsupportedTensorError:
    cls = type(t)
    return UnsupportedTensorError(
        f"tensor {name!r} is a {cls.__module__}.{cls.__qualname__} ({why}); offload cannot "
        f"move it. Supported formats: {SUPPORTED}"
    )


def _quant_state_tensors(name: str, state: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a bitsandbytes ``QuantState`` (nested ``state2`` included)."""
    if state is None:
        return
    for key, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            yield f"{name}.{key}", value
        elif key == "state2":
            yield from _quant_state_tensors(f"{name}.{key}", value)


def _flatten(name: str, t: torch.Tensor, outers: tuple[torch.Tensor, ...]) -> Iterator[Carrier]:
    inner_names, _ = t.__tensor_flatten__()
    flattened = set(inner_names)
    stray = [k for k in _tensor_attrs(t) if k not in flattened]
    if stray:
        raise _refuse(name, t, f"it holds tensors {stray} that __tensor_flatten__ does not name")
    chain = (t, *outers)
    for inner_name in inner_names:
        inner = getattr(t, inner_name)
        path = f"{name}.{inner_name}"
        kind = _kind(type(inner))
        if kind == "wrapper":
            yield from _flatten(path, inner, chain)
        elif kind in ("plain", "device"):
            yield Carrier(path, inner, chain)
        else:
            raise _refuse(path, inner, f"an inner tensor of a {type(t).__name__} that is not plain")


def carriers(name: str, t: torch.Tensor) -> list[Carrier]:
    """The plain tensors that carry weight ``t`` (registered as ``name``).

    Returns:
        ``t`` itself for a plain tensor, a subclass with storage and no tensor attributes,
        or a DTensor (its shard moves, ``transfer.payload_of``); a wrapper's inner
        tensors (with the wrapper in ``outers``); a bitsandbytes weight and its state
        tensors.

    Raises:
        UnsupportedTensorError (a TypeError): naming ``name``, ``t``'s class and
            ``SUPPORTED``.
    """
    kind = _kind(type(t))
    if kind == "plain":
        return [Carrier(name, t)]
    if kind == "Params4bit":
        return [Carrier(name, t)] + [
            Carrier(n, s) for n, s in _quant_state_tensors(f"{name}.quant_state", getattr(t, "quant_state", None))
        ]
    if kind == "Int8Params":
        extra = [Carrier(f"{name}.{k}", getattr(t, k)) for k in ("CB", "SCB") if isinstance(getattr(t, k, None), torch.Tensor)]
        return [Carrier(name, t), *extra]
    if kind == "wrapper":
        return list(_flatten(name, t, ()))
    if kind == "other" and not _has_storage(t):
        raise _refuse(name, t, "a wrapper subclass without __tensor_flatten__ / __tensor_unflatten__")
    stray = _tensor_attrs(t)
    if stray:
        raise _refuse(name, t, f"it holds tensors in attributes {stray} that would not move with it")
    return [Carrier(name, t)]


def module_carriers(prefix: str, module: nn.Module) -> list[Carrier]:
    """Tensors a module holds outside its parameters and buffers that carry weight bytes:
    bitsandbytes ``Linear8bitLt``'s ``state`` (``CB`` / ``SCB`` after its first forward,
    and its other state tensors). Empty for every other module."""
    if not _is_int8_linear(type(module)):
        return []
    state = getattr(module, "state", None)
    base = f"{prefix}.state" if prefix else "state"
    return [Carrier(f"{base}.{k}", v) for k, v in vars(state).items() if isinstance(v, torch.Tensor)]


@functools.cache
def _is_int8_linear(cls: type) -> bool:
    return any(c.__name__ == "Linear8bitLt" and c.__module__.startswith("bitsandbytes") for c in cls.__mro__)


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _rebuilt(outer: torch.Tensor) -> torch.Tensor:
    names, ctx = outer.__tensor_flatten__()
    inner = {n: getattr(outer, n) for n in names}
    return type(outer).__tensor_unflatten__(inner, ctx, outer.size(), outer.stride())


def check_rebuild(name: str, outer: torch.Tensor) -> None:
    """Check that ``refresh`` can rebuild wrapper ``outer``: ``__tensor_unflatten__`` of
    its own inner tensors gives its class, shape and dtype, viewing the same inner tensors.

    Raises:
        UnsupportedTensorError: naming ``name``, the class and ``SUPPORTED``.
    """
    try:
        again = _rebuilt(outer)
    except Exception as exc:  # noqa: BLE001 - any failure: not rebuildable
        raise _refuse(name, outer, f"__tensor_unflatten__ fails: {type(exc).__name__}: {exc}") from exc
    names, _ = outer.__tensor_flatten__()
    if (
        type(again) is not type(outer)
        or again.shape != outer.shape
        or again.dtype != outer.dtype
        or any(getattr(again, n) is not getattr(outer, n) for n in names)
    ):
        raise _refuse(name, outer, "__tensor_unflatten__ of its own inner tensors does not give it back")


def refresh(outers: tuple[torch.Tensor, ...]) -> None:
    """Bring each wrapper in ``outers`` (innermost first) to the device its inner tensors
    are on, once they all are on one device: its ``TensorImpl`` is exchanged for one
    rebuilt through ``__tensor_unflatten__`` from the same inner tensors (identity,
    class, ``__dict__`` and ``requires_grad`` kept). A wrapper whose inner tensors are on
    several devices (a move in progress) is left as it is. Host-side only."""
    for outer in outers:
        names, _ = outer.__tensor_flatten__()
        devices = {getattr(outer, n).device for n in names}
        if len(devices) != 1:
            return
        (device,) = devices
        if outer.device == device:
            continue
        requires_grad = outer.requires_grad
        with torch.inference_mode(False), torch.no_grad():
            rebuilt = _rebuilt(outer)
            torch._C._swap_tensor_impl(outer, rebuilt)
            if outer.requires_grad != requires_grad:
                outer.requires_grad_(requires_grad)

