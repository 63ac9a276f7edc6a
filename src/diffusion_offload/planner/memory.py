"""Measuring activation memory without memory: live-storage accounting on the meta device.

A stage's forward runs on the ``meta`` device (shapes and dtypes, no data, no compute)
under :class:`LiveBytes`, a ``TorchDispatchMode`` that counts the bytes of every storage an
op allocates while a tensor still references it, exactly as a device allocator would (and
as ``testing.fake_accelerator`` counts its device): a new storage adds its ``nbytes``; views
and in-place results add nothing; a storage is released when the last tensor viewing it is
garbage collected. Parameters and tensors made before the mode started are not counted
(they are the weights, counted separately from the safetensors headers).

The memory model follows the device kind (:data:`DEVICE_KINDS`), because attention kernels
differ in what they allocate:

* ``cuda`` (also ROCm), ``xpu``, ``npu``, ``fakegpu``: ``scaled_dot_product_attention`` runs a fused
  memory-efficient kernel (flash / memory-efficient attention): it allocates the output
  ``(B, H, Lq, Dv)`` and a float32 log-sum-exp ``(B, H, Lq)``, never the ``Lq x Lk`` score
  matrix. Modelled by intercepting ``F.scaled_dot_product_attention``. The fake device
  (``testing.fake_accelerator``) runs the op without gradient as one device op whose only
  device allocation is the output, as a fused kernel's (its log-sum-exp stays on the host).
* ``mps``: the math kernel (``aten::_scaled_dot_product_attention_math``, what torch 2.13
  picks for the meta device): half-precision inputs are
  upcast to float32, the scaled query, the ``(B, H, Lq, Lk)`` scores and their softmax
  are materialised. Measured by letting the meta device run that very decomposition.
* ``cpu``: torch 2.13's CPU dispatcher picks ``_scaled_dot_product_flash_attention_for_cpu``
  (checked: float32 and bfloat16, with and without masks), which allocates the output and
  the log-sum-exp only; modelled like ``cuda``. (Offload is a no-op on the CPU anyway.)

What is not modelled: allocator rounding and caching (CUDA rounds to 512-byte blocks and
keeps freed blocks reserved), the CUDA context (about 0.3-1 GiB outside torch's
allocator), and workspace memory that fused kernels take from outside the caching
allocator (cuBLAS/cuDNN workspaces). ``device_memory`` is the memory torch may allocate.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["DEVICE_KINDS", "LiveBytes", "attention_model", "describe_memory_model",
           "efficient_attention_kinds"]

DEVICE_KINDS: tuple[str, ...] = ("cuda", "xpu", "npu", "mps", "fakegpu", "cpu")
"""Device kinds the planner has a memory model for (``--device-kind``)."""

_EFFICIENT: tuple[str, ...] = ("cuda", "xpu", "npu", "fakegpu", "cpu")


def efficient_attention_kinds() -> tuple[str, ...]:
    """Device kinds whose attention allocates no score matrix (see the module docstring)."""
    return _EFFICIENT


_SCALAR_OPS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
               torch.ops.aten.item.default)


class LiveBytes(TorchDispatchMode):
    """Count the bytes of live storages allocated by ops run under this mode.

    Attributes:
        now: bytes of storages allocated under the mode and still referenced (bytes).
        peak: the maximum of ``now`` since the mode started or since :meth:`reset_peak`
            (bytes).

    Storages are keyed by their ``StorageImpl`` (``untyped_storage()._cdata``): a view
    shares its base's key and adds nothing; an op returning an alias of a storage made
    outside the mode (a view of a parameter) adds nothing either.
    """

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self._live: dict[int, list[int]] = {}  # storage key -> [tensor refs, nbytes]
        self.scalars = 0  # data-dependent scalars answered
        self._memo: dict[tuple, Any] = {}  # op + argument metadata -> output metadata

    def reset_peak(self) -> None:
        """``peak := now``."""
        self.peak = self.now

    def _scalar(self, t: torch.Tensor) -> Any:
        """The value of a data-dependent scalar on the meta device (``.item()``, ``bool()``).

        Models ask such questions about masks (``padding_mask.all()`` in transformers'
        masking: is there padding?). The answer taken is the one that makes the model
        build the explicit mask: ``False`` for booleans (a short prompt, padded to
        ``max_sequence_length``, as the pipelines pad), 0 for numbers.
        """
        self.scalars += 1
        if t.dtype == torch.bool:
            return False
        return 0 if not t.is_floating_point() else 0.0

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[key]
            self.now -= entry[1]

    def _track(self, t: torch.Tensor, fresh: bool) -> None:
        if t.__dict__.get("_planner_tracked") is self:
            return
        try:
            storage = t.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse/nested: no single storage
            return
        key = storage._cdata
        entry = self._live.get(key)
        if entry is None:
            if not fresh:  # an alias of a storage made outside the mode (a weight)
                return
            nbytes = storage.nbytes()
            self._live[key] = entry = [0, nbytes]
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        elif entry[1] != storage.nbytes():  # grown in place (resize_, out=)
            self.now += storage.nbytes() - entry[1]
            entry[1] = storage.nbytes()
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        t.__dict__["_planner_tracked"] = self
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func in _SCALAR_OPS and args[0].is_meta:
            return self._scalar(args[0])
        key = _memo_key(func, args, kwargs)
        if key is not None:
            layout = self._memo.get(key)
            if layout is not None:
                return self._replay_outputs(layout)
        out = func(*args, **kwargs)
        fresh = not _aliases(func)
        leaves = tree_leaves(out)
        for t in leaves:
            if isinstance(t, torch.Tensor):
                self._track(t, fresh)
        if key is not None:
            layout = _layout(out)
            if layout is not None and not _shares_input_storage(leaves, args, kwargs):
                self._memo[key] = layout
        return out

    def _replay_outputs(self, layout: Any) -> Any:
        """New meta tensors with the memoised metadata (same storage bytes, sizes, strides)."""
        if isinstance(layout, list):
            return tuple(self._replay_outputs(item) for item in layout)
        if layout is None:
            return None
        size, stride, offset, dtype, storage_bytes = layout
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        base = torch.empty((storage_bytes // itemsize,), dtype=dtype, device="meta")
        out = base.as_strided(size, stride, offset)
        del base
        self._track(out, True)
        return out


_MEMO_OK = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
            torch.layout)


def _aliases(func: Any) -> bool:
    schema = func._schema
    return schema.is_mutable or any(r.alias_info is not None for r in schema.returns)


def _memo_key(func: Any, args: tuple, kwargs: dict) -> tuple | None:
    """A hashable key of ``func`` and the metadata of its arguments, or None when the op's
    result is not a pure function of them (views, in-place and ``out=`` ops, random or
    non-meta arguments)."""
    if _aliases(func) or torch.Tag.nondeterministic_seeded in func.tags:
        return None
    parts: list[Any] = [func]
    for value in (*args, *sorted(kwargs.items())):
        item = _memo_item(value)
        if item is _NO_KEY:
            return None
        parts.append(item)
    return tuple(parts)


_NO_KEY = object()


def _memo_item(value: Any) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):  # kwarg pair
        inner = _memo_item(value[1])
        return _NO_KEY if inner is _NO_KEY else (value[0], inner)
    if isinstance(value, torch.Tensor):
        if not value.is_meta or value.layout != torch.strided:
            return _NO_KEY
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype)
    if isinstance(value, (list, tuple)):
        items = tuple(_memo_item(v) for v in value)
        return _NO_KEY if any(i is _NO_KEY for i in items) else ("L", items)
    if isinstance(value, _MEMO_OK):
        return (type(value).__name__, value)
    return _NO_KEY


def _shares_input_storage(outputs: list[Any], args: tuple, kwargs: dict) -> bool:
    """Whether an output views an input's storage although the schema says it does not
    (``aten._unsafe_view``): such ops are not memoised."""
    inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor) and t.layout == torch.strided}
    return any(isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in inputs for t in outputs)


def _layout(out: Any) -> Any:
    """Metadata to rebuild ``out`` (a tensor or a tuple/list of tensors and None)."""
    if isinstance(out, torch.Tensor):
        if not out.is_meta or out.layout != torch.strided:
            return None
        return (tuple(out.shape), out.stride(), out.storage_offset(), out.dtype,
                out.untyped_storage().nbytes())
    if isinstance(out, (tuple, list)) and out:
        items = [(_layout(o) if o is not None else None) for o in out]
        if any(i is None and o is not None for i, o in zip(items, out)):
            return None
        return items
    return None


class _EfficientAttention(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as a fused memory-efficient kernel allocates:
    the output ``(..., Lq, Dv)`` in the query's dtype and a float32 log-sum-exp
    ``(..., Lq)`` (freed at once: inference keeps no autograd state)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            query = args[0] if args else kwargs["query"]
            value = args[2] if len(args) > 2 else kwargs["value"]
            shape = (*query.shape[:-1], value.shape[-1])
            lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
            out = torch.empty(shape, dtype=query.dtype, device=query.device)
            del lse  # the log-sum-exp buffer: alive beside the output, then freed
            return out
        return func(*args, **kwargs)


class _NoOp:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def describe_memory_model(device_kind: str) -> str:
    """The attention memory model of ``device_kind`` in words (printed by ``plan``)."""
    if device_kind in _EFFICIENT:
        return "fused attention (flash/memory-efficient: output + log-sum-exp, no N x N scores)"
    return "math attention (float32 N x N scores and softmax materialised)"


def attention_model(device_kind: str) -> Callable[[], Any]:
    """A context-manager factory giving the attention memory model of ``device_kind``.

    Raises:
        ValueError: ``device_kind`` is not in :data:`DEVICE_KINDS`.
    """
    if device_kind not in DEVICE_KINDS:
        raise ValueError(f"device_kind={device_kind!r} is not allowed; allowed: {list(DEVICE_KINDS)}")
    return _EfficientAttention if device_kind in _EFFICIENT else _NoOp
