"""The ``fakegpu`` tensor and the path of every op on it: ``FakeDeviceTensor``, the
accounting of its storages (allocation, growth in place, free), ``storage_key``, and the
ATen dispatch, plain or inside the stream model (race checks, sequence numbers,
``record_stream``, copy timing).

When imported it registers ``FakeDeviceTensor`` and ``_dispatch`` as ``state.tensor_type``
and ``state.dispatch``, for the host dispatch mode of ``host_races.py`` (below it).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .counters import (
    _check_capacity,
    _count_copy,
    _count_host_wait,
    _count_op,
    _counters,
    _release,
    _reserve,
    _resize,
)
from .host_races import (
    _after_transfer,
    _blocking_device_read,
    _host_begin,
    _host_note,
    _host_pending,
    _mark_pinned,
    _prune_host,
)
from .races import (
    _StorageUse,
    _begin_op,
    _check_free,
    _done,
    _merge,
    _note_allocation,
    _op_kind,
    _raise_deferred,
    _returns_alias,
    _tracked,
)
from .state import DEVICE_TYPE, _current, _lock, state
from .streams import Stream, _as_stream

_aten = torch.ops.aten


def _release_storage(key: int) -> None:
    with _lock:
        entry = _counters.storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del _counters.storages[key]
            _release(entry)
            if _tracked:
                st = _tracked.pop(key, None)
                if st is not None:
                    _check_free(st)


def _track(inner: torch.Tensor) -> None:
    """Count ``inner``'s storage as device memory while ``inner`` is alive.

    Raises:
        torch.OutOfMemoryError: a new storage would exceed the capacity.
    """
    if inner.__dict__.get("_fakegpu_tracked"):
        return
    storage = inner.untyped_storage()
    key = storage._cdata
    with _lock:
        entry = _counters.storages.get(key)
        if entry is None:
            pool = _reserve(storage.nbytes())
            _counters.storages[key] = [1, storage.nbytes(), pool]
            if state.model_on:
                _note_allocation(key, inner)
        else:
            entry[0] += 1
    inner._fakegpu_tracked = True
    weakref.finalize(inner, _release_storage, key)


def _regrow(inner: torch.Tensor, before: int) -> None:
    """Account a storage that an op grew in place (``resize_``, ``out=``) from ``before`` bytes.

    Raises:
        torch.OutOfMemoryError: the growth exceeds the capacity (the storage is shrunk back
            to ``before`` bytes first, as a failed CUDA allocation leaves it).
    """
    storage = inner.untyped_storage()
    with _lock:
        entry = _counters.storages.get(storage._cdata)
        if entry is None or storage.nbytes() == entry[1]:
            return
        try:
            _resize(entry, storage.nbytes())
        except torch.OutOfMemoryError:
            storage.resize_(before)
            raise


class FakeDeviceTensor(torch.Tensor):
    """A tensor on the ``fakegpu`` device whose data lives in a CPU tensor ``_inner``.

    Users never build one directly: ``tensor.to("fakegpu")`` and factory functions with
    ``device="fakegpu"`` create them.
    """

    _inner: torch.Tensor

    #: the device's own tensor class: the offload core treats it as a plain tensor
    #: (``core.quantized.DEVICE_TENSOR``), ``_inner`` being its payload, not a weight's
    __device_tensor__ = True

    @staticmethod
    def __new__(cls, inner: torch.Tensor, requires_grad: bool | None = None) -> "FakeDeviceTensor":
        """Wrap the host tensor ``inner`` as a ``fakegpu`` tensor (the fake's own use).

        With ``requires_grad`` given, this is a library rebuilding a parameter as
        ``type(param)(data, requires_grad=...)`` (accelerate's
        ``set_module_tensor_to_device`` does): on ``fakegpu`` ``type(param)`` is this
        class (``nn.Parameter`` of a tensor subclass keeps the subclass and marks the
        instance), where on CUDA it is ``nn.Parameter``; so the result is what
        ``nn.Parameter(inner, requires_grad)`` gives, on ``inner``'s own device.
        """
        if requires_grad is not None:
            return torch.nn.Parameter(inner, requires_grad=requires_grad)
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=state.device,
            requires_grad=inner.requires_grad,
        )
        _track(inner)
        out._inner = inner
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        """The values, read as CUDA prints: a blocking host read on the current stream
        (one ``host_waits``; no device op or transfer is counted).

        Raises:
            RaceError: the tensor's last writer on another stream (a pending copy) is not
                ordered before the current stream or known complete by the host.
        """
        _count_host_wait()
        if state.model_on:
            _blocking_device_read(self, "repr() (host read)")
        return f"FakeDeviceTensor({self._inner!r}, device='{state.device}')"

    def tolist(self) -> Any:
        """Python values, as on CUDA: one device->host copy (counted in ``d2h_bytes``)."""
        return self.cpu().tolist()

    @classmethod
    @torch.compiler.disable
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: D105
        return _dispatch(func, args, kwargs or {})


def _is_host_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, FakeDeviceTensor)


def _unwrap(x: Any) -> Any:
    return x._inner if isinstance(x, FakeDeviceTensor) else x


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _device_kwarg_is(kwargs: dict, device_type: str) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == device_type


def _device_kwarg_is_host(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type != DEVICE_TYPE


# Non-view ops that launch no kernel on a GPU: allocation without a fill, metadata,
# allocator bookkeeping and queries answered from metadata (``device_ops`` leaves them out).
_NO_KERNEL = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "empty_permuted",
        "new_empty",
        "new_empty_strided",
        "_unsafe_view",
        "record_stream",
        "set_data",
        "is_same_size",
        "is_set_to",
        "is_pinned",
        "_has_compatible_shallow_copy_type",
        "_fused_sdp_choice",
        "sym_size",
        "sym_stride",
        "sym_numel",
        "sym_storage_offset",
    }
)
# ops whose result the host reads inside them on CUDA, beyond the tagged ones
_HOST_READ_OPS = frozenset({"_linalg_check_errors"})
# ops whose host wait depends on their arguments (the copy's direction, a boolean mask)
_WAIT_BY_ARGS = frozenset(
    {
        _aten.copy_.default,
        _aten._to_copy.default,
        _aten.index.Tensor,
        _aten.index_put.default,
        _aten.index_put_.default,
        _aten._index_put_impl_.default,
    }
)
_NOT_COUNTED, _DEVICE_OP, _DEVICE_OP_HOST_WAIT, _BY_ARGS = 0, 1, 2, 3
_op_counts: dict[Any, int] = {}  # func -> one of the four above


def _op_count(func: Any) -> int:
    """How one dispatch of ``func`` counts in ``device_ops`` and ``host_waits`` (cached)."""
    count = _op_counts.get(func)
    if count is None:
        tags = func.tags
        name = func._schema.name.split("::")[-1]
        if func.is_view or torch.Tag.inplace_view in tags or name in _NO_KERNEL:
            count = _NOT_COUNTED
        elif func in _WAIT_BY_ARGS:
            count = _BY_ARGS
        elif (
            name in _HOST_READ_OPS
            or torch.Tag.data_dependent_output in tags
            or torch.Tag.dynamic_output_shape in tags
        ):
            count = _DEVICE_OP_HOST_WAIT
        else:
            count = _DEVICE_OP
        _op_counts[func] = count
    return count


def _waits_by_args(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a dispatch of a ``_WAIT_BY_ARGS`` op makes the host wait: a copy to the
    host, or indexing with a boolean mask (CUDA turns the mask into ``nonzero``, whose
    output size the host reads)."""
    if func is _aten.copy_.default:
        return _is_host_tensor(args[0]) and isinstance(args[1], FakeDeviceTensor)
    if func is _aten._to_copy.default:
        return _device_kwarg_is_host(kwargs)
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    return any(
        isinstance(i, FakeDeviceTensor) and i.dtype in (torch.bool, torch.uint8) for i in indices
    )


def _dispatch(func, args, kwargs):
    """Run ``func`` on the inner host tensors (called from ``__torch_dispatch__``, which
    is ``torch.compiler.disable``d: nothing here is traced), and count it in
    ``device_ops``/``host_waits``: this is the one entry of an op on ``fakegpu`` tensors
    (nothing below it dispatches to it again), so each op counts once.

    Until a side stream is created or a copy bandwidth is set, ops take the plain path
    (no stream bookkeeping at all); afterwards ``_dispatch_modelled`` runs the race
    detector and the copy timing around it."""
    if func is _aten._has_compatible_shallow_copy_type.default:
        return _compatible_shallow_copy_type(args[0], args[1])
    if func is _aten._to_copy.default and _device_kwarg_is(kwargs, "meta"):
        # ``t.to("meta")``: a meta tensor of t's shape and dtype; no data moves (on CUDA
        # no kernel or copy either): no device op, transfer or host wait
        return func(_unwrap(args[0]), **kwargs)
    count = _op_count(func)
    if state.model_on:
        out = _dispatch_modelled(func, args, kwargs)
    elif func is _aten.record_stream.default:
        return _record_stream(args[0], args[1])
    elif func in _TRANSFER_OPS:
        out = _dispatch_transfer_plain(func, args, kwargs)
    else:
        out = _dispatch_plain(func, args, kwargs)
    if count:
        _count_op(
            count == _DEVICE_OP_HOST_WAIT
            or (count == _BY_ARGS and _waits_by_args(func, args, kwargs))
        )
    return out


def _compatible_shallow_copy_type(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch._has_compatible_shallow_copy_type(a, b)`` (whether ``a.data = b`` may swap
    storages in place; ``nn.Module._apply`` asks it): False between a ``fakegpu`` and a
    host tensor, as between a CUDA and a CPU tensor, else the answer for the payloads. A
    metadata query: no device op, never a device-mixing error."""
    if isinstance(a, FakeDeviceTensor) != isinstance(b, FakeDeviceTensor):
        return False
    return torch._has_compatible_shallow_copy_type(_unwrap(a), _unwrap(b))


def _dispatch_transfer_plain(func, args, kwargs):
    """A copy or host read outside the stream model (only the default stream exists).

    Only its host side is modelled: a non-blocking copy with a pinned host storage takes
    the default stream's next seq and stays pending for the host until a synchronize or
    a blocking copy; with nothing pending and nothing non-blocking it is ``_dispatch_plain``.

    Raises:
        RaceError: the copy races a pending copy from or into the same pinned host storage.
    """
    info = _host_transfer(func, args, kwargs)
    if info is None or not (_host_pending or info[2]):
        return _dispatch_plain(func, args, kwargs)
    host, write, non_blocking, op = info
    T = state.default_stream
    if host is None:  # _to_copy to the host (a pinned result when non-blocking), .item()
        pending = non_blocking
    else:
        pinned, non_blocking = _host_begin(T, host, write, non_blocking, op)
        pending = pinned and non_blocking
    if pending:
        with _lock:
            seq = T._clock[0] + 1
            T._clock[0] = seq
    out = _dispatch_plain(func, args, kwargs)
    if pending:
        if host is None:  # t.to("cpu", non_blocking=True): a pinned result, as on CUDA
            host = out
            _mark_pinned(out)
        _host_note(T, seq, host, write, op)
    elif not non_blocking and _host_pending:
        with _lock:
            _merge(_done, T._clock)
            _prune_host()
    return out


def _dispatch_plain(func, args, kwargs):
    """Run ``func`` on the inner host tensors, without stream bookkeeping."""
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        if isinstance(dst, FakeDeviceTensor) and _is_host_tensor(src):
            _count_copy("h2d", _nbytes(dst))
        elif _is_host_tensor(dst) and isinstance(src, FakeDeviceTensor):
            _count_copy("d2h", _nbytes(dst))
        _unwrap(dst).copy_(_unwrap(src), **{k: v for k, v in kwargs.items()})
        return dst

    if func is _aten._to_copy.default and _device_kwarg_is_host(kwargs):
        src = args[0]
        kw = dict(kwargs)
        kw["device"] = torch.device("cpu")
        kw.pop("non_blocking", None)
        out = func(_unwrap(src), **kw)
        _count_copy("d2h", _nbytes(out))
        return out

    if func is _aten._local_scalar_dense.default:  # ``.item()``: one device->host copy
        _count_copy("d2h", args[0].element_size())
        return func(_unwrap(args[0]))

    nested = any(isinstance(a, (list, tuple, dict)) for a in args) or any(
        isinstance(v, (list, tuple, dict)) for v in kwargs.values()
    )
    flat = pytree.tree_flatten((args, kwargs))[0] if nested else [*args, *kwargs.values()]
    host_indices = _host_indices(func, args, kwargs)
    for x in flat:
        if _is_host_tensor(x) and x.dim() > 0 and x.device.type == "cpu" and id(x) not in host_indices:
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, {state.device} and cpu! (in {func})"
            )

    if func._schema.is_mutable:  # resize_, out= ops: storages may grow, shapes change
        return _dispatch_mutating(func, args, kwargs, flat)

    host_out = _device_kwarg_is_host(kwargs)
    inners = {id(x._inner): x for x in flat if isinstance(x, FakeDeviceTensor)}
    if nested:
        u_args = pytree.tree_map(_unwrap, args)
        u_kwargs = pytree.tree_map(_unwrap, kwargs)
    else:  # the common case, without pytree's overhead
        u_args = tuple(_unwrap(a) for a in args)
        u_kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
    if "device" in u_kwargs and not host_out and u_kwargs["device"] is not None:
        u_kwargs["device"] = torch.device("cpu")
    out = func(*u_args, **u_kwargs)
    if host_out:
        return out

    def wrap(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeDeviceTensor):
            same = inners.get(id(x))
            if same is not None and same._inner is x:
                return same
            return FakeDeviceTensor(x)
        return x

    def wrap_all(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return wrap(x)
        return pytree.tree_map(wrap, x)

    if torch.is_inference_mode_enabled() and _returns_alias(func) and any(
        isinstance(x, FakeDeviceTensor) and not x.is_inference() for x in flat
    ):
        # a view of an ordinary tensor is ordinary, also inside inference mode (autograd
        # then gives it the base's version counter, which an inference tensor cannot hold)
        with torch.inference_mode(False):
            return wrap_all(out)
    return wrap_all(out)


_INDEX_OPS = frozenset(
    {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}
)


def _host_indices(func: Any, args: tuple, kwargs: dict) -> set[int]:
    """ids of the host index tensors CUDA accepts: ``t[idx]`` and ``t[idx] = v`` (``index``,
    ``index_put``) of a device tensor ``t`` take indices on the host (CUDA copies them to the
    device: counted as H2D bytes here; a host boolean mask needs no host wait). Every other
    op, or a host ``t``, still refuses a host tensor."""
    if func not in _INDEX_OPS or not isinstance(args[0] if args else kwargs.get("self"), FakeDeviceTensor):
        return set()
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    out = set()
    for i in indices:
        if isinstance(i, torch.Tensor) and _is_host_tensor(i):
            out.add(id(i))
            _count_copy("h2d", _nbytes(i))
    return out


def _dispatch_mutating(func, args, kwargs, flat):
    """Run an op that writes its arguments, as CUDA would: grown storages are counted and
    capped, and a written argument whose shape changed takes the new shape."""
    fakes = [x for x in flat if isinstance(x, FakeDeviceTensor)]
    before = {id(x): x._inner.untyped_storage().nbytes() for x in fakes}
    if func is _aten.resize_.default:
        self = args[0]
        needed = (self.storage_offset() + _numel(args[1])) * self.element_size()
        grow = needed - before[id(self)]
        if grow > 0:
            with _lock:
                _check_capacity(grow)
    out = func(*pytree.tree_map(_unwrap, args), **pytree.tree_map(_unwrap, kwargs))
    for x in fakes:
        inner = x._inner
        if inner.untyped_storage().nbytes() != before[id(x)]:
            _regrow(inner, before[id(x)])
        if (
            x.shape != inner.shape
            or x.stride() != inner.stride()
            or x.storage_offset() != inner.storage_offset()
        ):
            _reshape_wrapper(x)
    inners = {id(x._inner): x for x in fakes}
    return pytree.tree_map(
        lambda r: inners.get(id(r), FakeDeviceTensor(r))
        if isinstance(r, torch.Tensor) and not isinstance(r, FakeDeviceTensor)
        else r,
        out,
    )


def _numel(size) -> int:
    n = 1
    for d in size:
        n *= int(d)
    return n


def _reshape_wrapper(x: FakeDeviceTensor) -> None:
    """Give the wrapper ``x`` its inner tensor's new shape, keeping ``x``'s identity.

    A wrapper subclass's sizes are fixed at creation; CUDA changes a tensor's sizes in
    place (``resize_``, ``out=``). The same object is given a fresh wrapper's
    ``TensorImpl`` (``torch._C._swap_tensor_impl``), so the caller's variable sees it.
    """
    fresh = FakeDeviceTensor(x._inner)
    torch._C._swap_tensor_impl(x, fresh)


_TRANSFER_OPS = frozenset(
    {_aten.copy_.default, _aten._to_copy.default, _aten._local_scalar_dense.default}
)


def _host_transfer(func, args, kwargs):
    """(host tensor or None, whether the host memory is written, non_blocking, op name)
    of a transfer op (``copy_``, ``_to_copy`` to the host, ``.item()``); None if ``func``
    moves no data between host and device. The host tensor is None for a new result
    (``_to_copy``) and for ``.item()``."""
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        nb = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        if isinstance(dst, FakeDeviceTensor) and _is_host_tensor(src):
            return src, False, nb, "host-to-device copy"
        if _is_host_tensor(dst) and isinstance(src, FakeDeviceTensor):
            return dst, True, nb, "device-to-host copy (host read)"
        return None
    if func is _aten._to_copy.default:
        if not _device_kwarg_is_host(kwargs):
            return None
        nb = bool(kwargs.get("non_blocking", False))
        return None, True, nb, "device-to-host copy (host read)"
    return None, False, False, "host read (.item())"


def _copy_accesses(dst: Any, src: Any) -> tuple[list, str | None, str]:
    dfake, sfake = isinstance(dst, FakeDeviceTensor), isinstance(src, FakeDeviceTensor)
    accesses = []
    if dfake:
        accesses.append((dst, True))
    if sfake:
        accesses.append((src, False))
    if dfake and not sfake:
        return accesses, "h2d", "host-to-device copy"
    if sfake and not dfake:
        return accesses, "d2h", "device-to-host copy (host read)"
    return accesses, None, "copy_"


def _dispatch_modelled(func, args, kwargs):
    """``_dispatch_plain`` inside the stream model: race checks, seq numbers, copy timing."""
    if state.deferred:
        _raise_deferred()
    if func is _aten.record_stream.default:
        return _record_stream(args[0], args[1])
    T = _current()
    transfer = None
    non_blocking = pinned = False
    host = None
    if func is _aten.copy_.default:
        accesses, transfer, op = _copy_accesses(args[0], args[1])
        non_blocking = bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))
        if transfer is not None:
            host = args[1] if transfer == "h2d" else args[0]
            pinned, non_blocking = _host_begin(T, host, transfer == "d2h", non_blocking, op)
    elif func is _aten._to_copy.default and _device_kwarg_is_host(kwargs):
        accesses, transfer, op = [(args[0], False)], "d2h", "device-to-host copy (host read)"
        non_blocking = pinned = bool(kwargs.get("non_blocking", False))  # a pinned result
    elif func is _aten._local_scalar_dense.default:
        accesses, transfer, op = [(args[0], False)], "d2h", "host read (.item())"
    else:
        kind = _op_kind(func)
        if kind is None:
            return _dispatch_plain(func, args, kwargs)
        pos, names, op = kind
        accesses = []
        for i, a in enumerate(args):
            if isinstance(a, FakeDeviceTensor):
                accesses.append((a, i in pos))
            elif isinstance(a, (list, tuple)):
                accesses.extend((b, i in pos) for b in a if isinstance(b, FakeDeviceTensor))
        for k, v in kwargs.items():
            if isinstance(v, FakeDeviceTensor):
                accesses.append((v, k in names))
            elif isinstance(v, (list, tuple)):
                accesses.extend((b, k in names) for b in v if isinstance(b, FakeDeviceTensor))
    seq = _begin_op(T, accesses, op)
    out = _dispatch_plain(func, args, kwargs)
    if T._sid != 0:
        _mark_outputs(T, out, seq, op, accesses)
    if transfer is not None:
        if func is _aten.copy_.default:
            nbytes = _nbytes(args[0])
        elif func is _aten._to_copy.default:
            nbytes = _nbytes(out)
            if non_blocking:  # as on CUDA: the result is pinned, the copy pending for the host
                host = out
                _mark_pinned(out)
        else:
            nbytes = args[0].element_size()
        if pinned and non_blocking:
            _host_note(T, seq, host, transfer == "d2h", op)
        _after_transfer(T, nbytes, non_blocking)
    return out


def _mark_outputs(T: Stream, out: Any, seq: int, op: str, accesses: list) -> None:
    """Note the new storages an op on side stream ``T`` produced as written at ``seq``."""
    if isinstance(out, FakeDeviceTensor):
        outs = [out]
    elif isinstance(out, (list, tuple)):
        outs = [o for o in pytree.tree_leaves(out) if isinstance(o, FakeDeviceTensor)]
    else:
        return
    if not outs:
        return
    inputs = {x._inner.untyped_storage()._cdata for x, _ in accesses}
    sid = T._sid
    with _lock:
        for o in outs:
            key = o._inner.untyped_storage()._cdata
            if key in inputs:
                continue
            st = _tracked.get(key)
            if st is None:
                st = _tracked[key] = _StorageUse(sid, o._inner.shape, o.dtype)
            st.uses[sid] = st.writes[sid] = (seq, op)


def _record_stream(t: torch.Tensor, s: Any) -> None:
    """``aten::record_stream``: uses of ``t`` on ``s`` no longer make freeing ``t`` a race
    (the caching allocator would defer reuse of the memory until that work completes)."""
    if not isinstance(t, FakeDeviceTensor):
        raise TypeError(f"record_stream takes a {DEVICE_TYPE} tensor, got one on {t.device}")
    if state.deferred:
        _raise_deferred()
    u = _as_stream(s)._sid
    key = t._inner.untyped_storage()._cdata
    with _lock:
        st = _tracked.get(key)
        if st is None:
            if u == 0:
                return None  # default-stream-only storage: nothing to defer
            st = _tracked[key] = _StorageUse(0, t._inner.shape, t.dtype)
        st.recorded.add(u)
    return None


def storage_key(t: torch.Tensor) -> int:
    """The key of ``live_storages`` for the ``fakegpu`` tensor ``t``.

    Raises:
        TypeError: ``t`` is not on the fake device.
    """
    if not isinstance(t, FakeDeviceTensor):
        raise TypeError(f"storage_key takes a {DEVICE_TYPE} tensor, got one on {t.device}")
    return t._inner.untyped_storage()._cdata


# the host dispatch mode (host_races.py, below this module) hands fakegpu ops to _dispatch
state.tensor_type = FakeDeviceTensor
state.dispatch = _dispatch
