"""A Python-implemented accelerator for testing placement on CPU-only machines.

``install()`` registers PyTorch's PrivateUse1 backend under the name ``"fakegpu"``
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``, PyTorch
>= 2.6) and backs every ``fakegpu`` tensor with an ordinary CPU tensor held inside a
wrapper subclass. Every ATen op on a ``fakegpu`` tensor unwraps, runs on the CPU and
re-wraps, so whole diffusers/transformers models run on it with real data.

What it gives a test that a CPU run cannot:

* **Placement errors.** An op that mixes a ``fakegpu`` tensor with a host (CPU) tensor
  of one or more dimensions raises ``RuntimeError("Expected all tensors to be on the
  same device, but found at least two devices, fakegpu:0 and cpu!")``, the message CUDA
  gives. Zero-dimensional host tensors are accepted as scalars, as on CUDA.
* **Exact accounting.** ``stats()`` counts device bytes of live storages
  (``allocated_bytes``; a view adds 0), their high-water mark (``peak_bytes``), bytes
  copied host->device (``h2d_bytes``) and device->host (``d2h_bytes``), one ``transfers``
  per tensor copy between host and device, and ``synchronizes``.
* **Capacity.** ``set_capacity(nbytes)`` makes an allocation that would push
  ``allocated_bytes`` above ``nbytes`` raise ``torch.OutOfMemoryError``.
* **``.data`` assignment across host and device** works as on CUDA (``install`` puts a
  ``data`` property on ``torch.Tensor`` that handles the ``fakegpu`` case and defers to
  PyTorch otherwise), so libraries that move weights with ``p.data = t`` run too.
* **Pinning.** ``Tensor.pin_memory()`` / ``Tensor.is_pinned()`` work on host tensors
  (CPU kernels for ``aten::_pin_memory`` and ``aten::is_pinned`` registered with
  ``torch.library``). A pinned tensor is an ordinary CPU tensor whose storage is
  remembered as pinned until that storage is freed. ``torch.fakegpu.host_register`` /
  ``host_unregister`` simulate ``cudaHostRegister`` (pinning an existing storage in place).

* **Streams, events and a race detector.** ``Stream``, ``Event``, ``current_stream``,
  ``stream(s)`` (also as ``torch.fakegpu.*``, shaped like ``torch.cuda.*``) model CUDA
  stream ordering. Data is still computed at once on the CPU; what is modelled is when
  work would be complete on a GPU. Every op on a ``fakegpu`` tensor runs on the current
  stream and takes its next sequence number; each stream keeps a vector clock of what it
  is ordered after (``wait_event`` on an event, which snapshots the recording stream's
  clock, or ``wait_stream``), and the host keeps one of what it knows complete
  (``synchronize()``, ``Stream.synchronize``, ``Event.synchronize``, a ``query()`` that
  returns True, a blocking copy). Device storages allocated on a side stream, or touched
  by an op on one, are *tracked*: the last use and last write per stream are noted. An op
  raises ``RaceError`` (naming the tensor's shape and dtype and both streams) when it
  reads or writes a tracked storage whose last write on another stream is not ordered
  before it, or writes one that another stream's unordered op still uses. Host reads
  (``.cpu()``, ``.item()``, ``.tolist()``, device->host copies) are ops on the current
  stream like any other. Freeing a tracked storage while a stream other than its
  allocation stream used it, unordered before the allocation stream's clock and not
  covered by a synchronize or ``tensor.record_stream(that stream)``, is a race too; frees
  happen in finalizers, so that ``RaceError`` is raised by the next ``fakegpu`` op or
  stream/event call. ``stats()`` counts ``stream_waits``, ``events`` and
  ``races_detected`` (every race found, raised or not). Views and metadata ops
  (``detach``, ``t``, ``view``, ``empty_like``...) access no data and are never races.
  Storages only ever used on the default stream stay untracked; until the first side
  stream is created (or a bandwidth set) ops take the plain path with no stream
  bookkeeping at all.
* **Host-side races on pinned memory.** The host is a participant of its own: its clock
  (what it knows complete) advances only by ``synchronize()``, ``Stream.synchronize``,
  ``Event.synchronize``, a ``query()`` returning True, or a blocking copy/``.item()``/
  ``.cpu()``/``.tolist()`` on a stream, which brings in everything that stream was
  ordered after (its waits, transitively). A ``non_blocking`` copy between the device and
  a pinned host storage (``pin_memory()``, ``host_register``, the pinned result of
  ``t.to("cpu", non_blocking=True)``) is *pending* on the host side until the host's
  clock covers it, on the default stream too (on CUDA such a copy is asynchronous to
  the host on any stream). While one is pending, any torch op on the host that reads a
  storage a pending device-to-host copy writes, or writes one that a pending copy reads
  or writes, raises ``RaceError``; so does ``repr()``/``print``/``.tolist()`` of it, and a
  copy on a stream not ordered after the pending one. Reading the source of a pending
  host-to-device copy is no race. Host ops are seen through a ``TorchDispatchMode`` pushed
  on the issuing thread only while such copies are pending (never on top of another
  active mode: a copy issued under a user's mode puts it beneath that mode); it costs
  nothing when none is pending. Copies to or from pageable memory are
  synchronous for host memory, as on CUDA, and never pending. Not seen: access outside
  torch (``.numpy()`` and the arrays it shares memory with, ``data_ptr()``, buffers,
  ``torch.save``), and ops on another thread than the one that issued the copy.
  ``repr()`` of a ``fakegpu`` tensor is a blocking host read on the current stream: it
  raises ``RaceError`` if the tensor's writer on another stream is not ordered before it.
* **Copy time.** ``set_copy_bandwidth(bytes_per_second)`` makes host<->device copies
  take ``nbytes / bytes_per_second`` seconds of virtual time per stream: a
  ``non_blocking`` copy on a side stream returns at once, a blocking copy or any copy on
  the default stream sleeps the host until done, and waits and synchronizes sleep until
  the awaited work completes. Compute takes its real CPU time, so copy/compute overlap
  from prefetching shows in wall-clock time.

What it cannot simulate: real asynchronous execution and its timing beyond that model,
allocator caching and fragmentation. Those exist only on a real GPU (see
``bench/gpu_check.py``).

The device type can be registered once per process; ``install()`` is idempotent and
raises ``RuntimeError`` if PrivateUse1 was already renamed to something else.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "DEVICE_TYPE",
    "Event",
    "FakeDeviceTensor",
    "RaceError",
    "Stream",
    "StreamContext",
    "current_stream",
    "default_stream",
    "install",
    "is_installed",
    "live_storages",
    "reset_peak",
    "reset_stats",
    "set_capacity",
    "set_copy_bandwidth",
    "set_stream",
    "stats",
    "storage_key",
    "stream",
    "synchronize",
]

DEVICE_TYPE = "fakegpu"
_aten = torch.ops.aten
_DEVICE: torch.device  # set by install(); torch.device("fakegpu") needs the rename first

# What ``torch.fakegpu.mem_get_info`` reports as total memory when no capacity is set.
_UNLIMITED_TOTAL = 1 << 50

_lock = threading.RLock()
_installed = False
_libs: list[torch.library.Library] = []  # keep registrations alive


class _Counters:
    """Process-wide counters of the fake device (all sizes in bytes)."""

    def __init__(self) -> None:
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.transfers = 0
        self.synchronizes = 0
        self.stream_waits = 0
        self.events = 0
        self.races_detected = 0
        self.capacity: int | None = None
        # StorageImpl address (``UntypedStorage._cdata``, stable across ``resize_``) ->
        # [number of live inner tensors, storage nbytes]
        self.storages: dict[int, list[int]] = {}
        # data pointers of pinned host storages
        self.pinned: set[int] = set()


_counters = _Counters()


def _release_storage(key: int) -> None:
    with _lock:
        entry = _counters.storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del _counters.storages[key]
            _counters.allocated_bytes -= entry[1]
            if _tracked:
                st = _tracked.pop(key, None)
                if st is not None:
                    _check_free(st)


def _reserve(nbytes: int) -> None:
    """Count ``nbytes`` more device bytes, or raise ``torch.OutOfMemoryError`` (lock held)."""
    capacity = _counters.capacity
    if capacity is not None and nbytes > 0 and _counters.allocated_bytes + nbytes > capacity:
        raise torch.OutOfMemoryError(
            f"fakegpu out of memory: tried to allocate {nbytes} bytes with "
            f"{_counters.allocated_bytes} bytes allocated and a capacity of {capacity} bytes"
        )
    _counters.allocated_bytes += nbytes
    _counters.peak_bytes = max(_counters.peak_bytes, _counters.allocated_bytes)


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
            _reserve(storage.nbytes())
            _counters.storages[key] = [1, storage.nbytes()]
            if _model_on:
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
            _reserve(storage.nbytes() - entry[1])
        except torch.OutOfMemoryError:
            storage.resize_(before)
            raise
        entry[1] = storage.nbytes()


class FakeDeviceTensor(torch.Tensor):
    """A tensor on the ``fakegpu`` device whose data lives in a CPU tensor ``_inner``.

    Users never build one directly: ``tensor.to("fakegpu")`` and factory functions with
    ``device="fakegpu"`` create them.
    """

    _inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> "FakeDeviceTensor":
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            layout=inner.layout,
            device=_DEVICE,
            requires_grad=inner.requires_grad,
        )
        _track(inner)
        out._inner = inner
        return out

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        """The values, read as CUDA prints: a blocking host read on the current stream.

        Raises:
            RaceError: the tensor's last writer on another stream (a pending copy) is not
                ordered before the current stream or known complete by the host.
        """
        if _model_on:
            _blocking_device_read(self, "repr() (host read)")
        return f"FakeDeviceTensor({self._inner!r}, device='{_DEVICE}')"

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


def _count_copy(direction: str, nbytes: int) -> None:
    with _lock:
        if direction == "h2d":
            _counters.h2d_bytes += nbytes
        else:
            _counters.d2h_bytes += nbytes
        _counters.transfers += 1


def _device_kwarg_is_host(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type != DEVICE_TYPE


def _dispatch(func, args, kwargs):
    """Run ``func`` on the inner host tensors (called from ``__torch_dispatch__``, which
    is ``torch.compiler.disable``d: nothing here is traced).

    Until a side stream is created or a copy bandwidth is set, ops take the plain path
    (no stream bookkeeping at all); afterwards ``_dispatch_modelled`` runs the race
    detector and the copy timing around it."""
    if _model_on:
        return _dispatch_modelled(func, args, kwargs)
    if func is _aten.record_stream.default:
        return _record_stream(args[0], args[1])
    if func in _TRANSFER_OPS:
        return _dispatch_transfer_plain(func, args, kwargs)
    return _dispatch_plain(func, args, kwargs)


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
    T = _default_stream
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
    for x in flat:
        if _is_host_tensor(x) and x.dim() > 0 and x.device.type == "cpu":
            raise RuntimeError(
                "Expected all tensors to be on the same device, but found at least two "
                f"devices, {_DEVICE} and cpu! (in {func})"
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
                capacity = _counters.capacity
                if capacity is not None and _counters.allocated_bytes + grow > capacity:
                    raise torch.OutOfMemoryError(
                        f"fakegpu out of memory: tried to allocate {grow} bytes with "
                        f"{_counters.allocated_bytes} bytes allocated and a capacity of "
                        f"{capacity} bytes"
                    )
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


def _returns_alias(func) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


# ----------------------------------------------------------------------------- .data

_TENSOR_DATA = torch._C.TensorBase.data  # the C++ getset descriptor


def _data_get(self: torch.Tensor) -> torch.Tensor:
    return _TENSOR_DATA.__get__(self)


def _data_set(self: torch.Tensor, new: torch.Tensor) -> None:
    """``t.data = new`` as CUDA behaves, also across host and ``fakegpu`` tensors.

    PyTorch refuses ``set_data`` between CPU and PrivateUse1 tensors ("incompatible
    tensor type": its shallow-copy compatibility list leaves PrivateUse1 out), while
    CPU<->CUDA works. Across that boundary, ``t`` is pointed at an alias of ``new``'s
    storage with ``torch.utils.swap_tensors`` (identity and Parameter-ness kept).
    Between two fake tensors the payload is rebound too (``set_data`` alone copies only
    the wrapper's metadata).
    """
    fake_self, fake_new = isinstance(self, FakeDeviceTensor), isinstance(new, FakeDeviceTensor)
    if fake_self != fake_new:
        _rebind_across(self, new)
        return
    _TENSOR_DATA.__set__(self, new)
    if fake_self:
        self._inner = new._inner


_HOST_CLASS = "_fakegpu_host_class"
_device_classes: dict[type, type] = {}


def _device_class(host_class: type) -> type:
    """The class a tensor of ``host_class`` has on the fake device.

    Plain tensors and Parameters become ``FakeDeviceTensor``. A subclass (diffusers'
    ``GGUFParameter``, a quantized Parameter) keeps being an instance of it, as with
    ``.data =`` on CUDA: the device class derives from both ``FakeDeviceTensor`` (for
    the device's dispatch) and ``host_class`` (its methods, ``__torch_function__`` and
    attributes). When the subclass re-wraps an op's result as ``cls(result, **kw)``, the
    result gets the attributes ``host_class``'s constructor computes for those arguments.
    """
    if host_class in (torch.Tensor, torch.nn.Parameter) or issubclass(host_class, FakeDeviceTensor):
        return FakeDeviceTensor
    cls = _device_classes.get(host_class)
    if cls is None:

        def __new__(cls, data=None, *args, **kwargs):  # noqa: N807
            inner = data._inner if isinstance(data, FakeDeviceTensor) else data
            out = FakeDeviceTensor.__new__(cls, inner)
            with torch.inference_mode(False), torch.no_grad():
                model = host_class(inner.detach(), *args, **kwargs)
            out.__dict__.update({k: v for k, v in model.__dict__.items() if k != "_inner"})
            out.__dict__[_HOST_CLASS] = host_class
            return out

        cls = type(
            f"FakeDevice{host_class.__name__}",
            (FakeDeviceTensor, host_class),
            {"__new__": __new__, "__module__": __name__},
        )
        _device_classes[host_class] = cls
    return cls


def _rebind_across(self: torch.Tensor, new: torch.Tensor) -> None:
    """``self.data = new`` across host and ``fakegpu``, as ``set_data`` does on CUDA.

    The object ``self`` keeps its identity, its attributes, Parameter-ness and
    ``requires_grad``, and it works whoever else references ``self`` (a live autograd
    graph, weakrefs from compiled code): the payload is exchanged at the ``TensorImpl``
    level (``torch._C._swap_tensor_impl``), which, unlike ``torch.utils.swap_tensors``,
    does not refuse shared tensors. References taken earlier (an autograd graph's saved
    tensors) keep the old payload, as ``set_data`` leaves them the old storage on CUDA.
    """
    requires_grad = self.requires_grad
    is_param = isinstance(self, torch.nn.Parameter)
    attrs = {k: v for k, v in self.__dict__.items() if k not in ("_inner", _HOST_CLASS)}
    if isinstance(self, FakeDeviceTensor):  # born on the device: its host class by kind
        host_class = self.__dict__.get(
            _HOST_CLASS, torch.nn.Parameter if is_param else torch.Tensor
        )
    else:
        host_class = type(self)
    with torch.inference_mode(False), torch.no_grad():
        alias = new.detach()
    torch._C._swap_tensor_impl(self, alias)
    if isinstance(new, FakeDeviceTensor):
        self.__class__ = _device_class(host_class)
        attrs["_inner"] = alias.__dict__["_inner"]
        attrs[_HOST_CLASS] = host_class
        attrs["_is_param"] = is_param
    else:
        self.__class__ = host_class
        attrs.pop("_is_param", None)
    self.__dict__.clear()
    self.__dict__.update(attrs)
    if self.requires_grad != requires_grad:
        self.requires_grad_(requires_grad)


# ----------------------------------------------------------------------------- kernels


@torch.compiler.disable
def _empty_memory_format(
    size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    inner = torch.empty(
        size,
        dtype=dtype,
        layout=layout or torch.strided,
        memory_format=memory_format or torch.contiguous_format,
    )
    return FakeDeviceTensor(inner)


@torch.compiler.disable
def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    inner = torch.empty_strided(size, stride, dtype=dtype, layout=layout or torch.strided)
    return FakeDeviceTensor(inner)


@torch.compiler.disable
def _copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``aten::_copy_from`` for copies that reach the backend below Python dispatch
    (``torch.tensor(data, device="fakegpu")`` copies this way)."""
    host_side = _is_host_tensor(self) != _is_host_tensor(dst)
    if _model_on:
        if _deferred:
            _raise_deferred()
        T = _current()
        accesses, transfer, op = _copy_accesses(dst, self)
        host = (self if transfer == "h2d" else dst) if host_side else None
        pinned, non_blocking = _host_begin(T, host, transfer == "d2h", non_blocking, op)
        seq = _begin_op(T, accesses, op)
        _copy_from_plain(self, dst)
        if pinned and non_blocking:
            _host_note(T, seq, host, transfer == "d2h", op)
        if transfer is not None:
            _after_transfer(T, _nbytes(dst), non_blocking)
        return dst
    if host_side and (non_blocking or _host_pending):
        _dispatch_transfer_plain(_aten.copy_.default, (dst, self, non_blocking), {})
        return dst
    return _copy_from_plain(self, dst)


def _copy_from_plain(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if isinstance(dst, FakeDeviceTensor) and _is_host_tensor(self):
        _count_copy("h2d", _nbytes(dst))
    elif _is_host_tensor(dst) and isinstance(self, FakeDeviceTensor):
        _count_copy("d2h", _nbytes(dst))
    _unwrap(dst).copy_(_unwrap(self))
    return dst


@torch.compiler.disable
def _arange(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten::arange.start_step`` (and ``.start``): PyTorch's composite fills an empty
    tensor through ``arange.out``, whose resize a wrapper tensor cannot show (its sizes
    are fixed at creation); build the result whole."""
    out = FakeDeviceTensor(torch.arange(start, end, step, dtype=dtype))
    _note_kernel_write(out, "aten.arange")
    return out


@torch.compiler.disable
def _arange_end(end, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten::arange``: see ``_arange``."""
    out = FakeDeviceTensor(torch.arange(end, dtype=dtype))
    _note_kernel_write(out, "aten.arange")
    return out


@torch.compiler.disable
def _linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten::linspace``, built whole for the same reason as ``_arange``."""
    out = FakeDeviceTensor(torch.linspace(start, end, steps, dtype=dtype))
    _note_kernel_write(out, "aten.linspace")
    return out


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    out = torch.empty_like(self, memory_format=torch.preserve_format)
    out.copy_(self)
    _mark_pinned(out)
    return out


def _mark_pinned(t: torch.Tensor) -> None:
    """Remember the host storage of ``t`` as pinned until that storage is freed."""
    key = t.untyped_storage().data_ptr()
    with _lock:
        _counters.pinned.add(key)
    weakref.finalize(t.untyped_storage(), _unpin, key)


def _unpin(key: int) -> None:
    """The storage at ``key`` is pageable again (unregistered or freed): its pending
    copies are no longer tracked."""
    with _lock:
        _counters.pinned.discard(key)
        _host_pending.pop(key, None)


def _is_pinned(self: torch.Tensor, device=None) -> bool:
    if self.device.type != "cpu":
        return False
    with _lock:
        return self.untyped_storage().data_ptr() in _counters.pinned


# ----------------------------------------------------------------------------- streams


class RaceError(RuntimeError):
    """A stream-ordering bug found by the fake device's race detector.

    Raised by the op (or the stream/event call) that would race on a real GPU: a read or
    write of a tensor whose writer on another stream is not ordered before it, a write
    over a pending use on another stream, or (raised at the next ``fakegpu`` call) the
    free of a tensor still in use on a stream other than the one it was allocated on. On
    the host side: a torch op (``repr()`` and ``.tolist()`` included) reading a pinned host
    tensor that a pending non-blocking device-to-host copy writes, or writing one that a
    pending copy reads or writes, before the host waited for that copy.
    """


_model_on = False  # a side stream exists or a copy bandwidth is set: ops take the model path
_bandwidth: float | None = None  # bytes per second of host<->device copies; None: instant
_tls = threading.local()  # .stream: the thread's current Stream (None: the default stream)
_streams: dict[int, "Stream"] = {}  # stream id -> the one Stream object with that id
_default_stream: "Stream | None" = None  # id 0, made by install()
_done: dict[int, int] = {}  # stream id -> highest seq the host knows to be complete
_tracked: dict[int, "_StorageUse"] = {}  # storage key -> its uses, by stream
_deferred: list[str] = []  # races found at frees, raised at the next fakegpu call
_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)
_MISSING = object()
_op_kinds: dict[Any, Any] = {}
# ops that launch no kernel on a GPU (metadata, allocation): no access to the data
_NO_ACCESS = frozenset(
    {
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "is_same_size",
        "_has_compatible_shallow_copy_type",
        "_unsafe_view",
        "set_",
        "is_pinned",
    }
)


class _StorageUse:
    """What the detector knows of one tracked device storage."""

    __slots__ = ("alloc", "uses", "writes", "recorded", "shape", "dtype")

    def __init__(self, alloc: int, shape: Any, dtype: torch.dtype) -> None:
        self.alloc = alloc  # id of the stream it was allocated on
        self.uses: dict[int, tuple[int, str]] = {}  # stream id -> (seq, op) of last use
        self.writes: dict[int, tuple[int, str]] = {}  # stream id -> (seq, op) of last write
        self.recorded: set[int] = set()  # stream ids given to tensor.record_stream
        self.shape = tuple(shape)
        self.dtype = dtype


def _sname(sid: int) -> str:
    return f"stream {sid} ({'default' if sid == 0 else 'side'})"


def _merge(into: dict[int, int], clock: dict[int, int]) -> None:
    for k, v in clock.items():
        if v > into.get(k, 0):
            into[k] = v


def _sleep_until(t: float) -> None:
    """Block the host until ``time.perf_counter() >= t``: a sleep for all but the last
    millisecond, then a spin, so that short waits (a copy finishing just after the
    compute it overlapped) cost their length and not a scheduler wake-up."""
    delay = t - time.perf_counter()
    if delay > 0.002:
        time.sleep(delay - 0.001)
    while time.perf_counter() < t:
        pass


def _require_installed() -> None:
    if _default_stream is None:
        raise RuntimeError("fakegpu streams need fake_accelerator.install() first")


def _check_device(device: Any) -> None:
    if device is None:
        return
    if isinstance(device, int) and not isinstance(device, bool):
        ok = device == 0
    else:
        try:
            d = torch.device(device)
        except (RuntimeError, TypeError):
            ok = False
        else:
            ok = d.type == DEVICE_TYPE and d.index in (None, 0)
    if not ok:
        raise ValueError(f"not a {DEVICE_TYPE} device (it has one, index 0): {device!r}")


def _current() -> "Stream":
    s = getattr(_tls, "stream", None)
    return _default_stream if s is None else s  # type: ignore[return-value]


def _as_stream(s: Any) -> "Stream":
    """Our ``Stream`` for ``s`` (a ``Stream`` or a ``torch.Stream`` naming a fakegpu stream)."""
    if isinstance(s, Stream):
        return s
    if isinstance(s, torch.Stream):
        if s.device_type == _PRIVATEUSE1 and s.stream_id in _streams:
            return _streams[s.stream_id]
        raise ValueError(f"not a {DEVICE_TYPE} stream: {s!r}")
    raise TypeError(f"expected a {DEVICE_TYPE} Stream, got {type(s).__name__}")


def _raise_deferred() -> None:
    """Raise the races found at frees since the last call (they could not raise there)."""
    if not _deferred:
        return
    with _lock:
        msgs = list(_deferred)
        _deferred.clear()
    if msgs:
        more = f" (and {len(msgs) - 1} more race(s) found at frees)" if len(msgs) > 1 else ""
        raise RaceError(msgs[0] + more)


class Stream(torch.Stream):
    """A simulated stream of the ``fakegpu`` device, shaped like ``torch.cuda.Stream``.

    ``Stream()`` makes a new side stream (ids 1, 2, ...); the default stream is id 0
    (``default_stream()``). It is a ``torch.Stream`` (device type PrivateUse1), so
    ``tensor.record_stream(s)`` accepts it. Work is never really asynchronous: every op
    runs at once on the CPU, and the stream only keeps the ordering facts the race
    detector needs (a sequence number per op, a vector clock of what it has waited on)
    and, with ``set_copy_bandwidth``, the virtual time its copies complete. Device
    memory allocated while a side stream is current belongs to that stream, as with the
    CUDA caching allocator (``host.to(dev, non_blocking=True)`` inside ``stream(s)``
    allocates on ``s``).

    Args:
        device: ``None``, ``0``, ``"fakegpu"``, ``"fakegpu:0"`` or that ``torch.device``.
        priority: accepted for ``torch.cuda`` compatibility; ignored.

    Raises:
        ValueError: ``device`` is not the fake device.
        RuntimeError: ``install()`` has not run.
    """

    _sid: int
    _clock: dict[int, int]
    _busy_until: float

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        _check_device(device)
        _require_installed()
        with _lock:
            if "stream_id" in kwargs:  # torch.Stream-style re-wrap of an existing stream
                existing = _streams.get(kwargs["stream_id"])
                if existing is None:
                    raise ValueError(f"no {DEVICE_TYPE} stream with id {kwargs['stream_id']}")
                return existing
            return cls._make(len(_streams), priority)

    @classmethod
    def _make(cls, sid: int, priority: int = 0) -> "Stream":
        """The stream with id ``sid`` (0: the default stream, made by ``install``)."""
        global _model_on
        self = torch.Stream.__new__(cls, stream_id=sid, device_type=_PRIVATEUSE1, device_index=0)
        self._sid = sid
        self.priority = priority
        self._clock = {sid: 0}
        self._busy_until = 0.0
        _streams[sid] = self
        if sid != 0:
            _model_on = True
        return self

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        pass  # all set in __new__

    def __repr__(self) -> str:
        return f"<{DEVICE_TYPE} Stream id={self._sid} ({'default' if self._sid == 0 else 'side'})>"

    def wait_event(self, event: "Event") -> None:
        """Order all later work on this stream after ``event`` (no-op if never recorded).

        On the default stream (whose compute runs on the host in this fake) the host
        sleeps until the event's virtual completion time; on a side stream the stream's
        next copies start no earlier than that time. Counts one ``stream_waits``.

        Raises:
            RaceError: a race found at an earlier free is pending.
            TypeError: ``event`` is not a fakegpu ``Event``.
        """
        if not isinstance(event, Event):
            raise TypeError(f"expected a {DEVICE_TYPE} Event, got {type(event).__name__}")
        _raise_deferred()
        with _lock:
            _counters.stream_waits += 1
            if event._clock is None:
                return
            ready = self._order_after(event._clock, event._ready)
        _sleep_until(ready)

    def wait_stream(self, stream: "Stream") -> None:
        """Order all later work on this stream after all work queued on ``stream`` now.

        Timing as ``wait_event``. Counts one ``stream_waits``.

        Raises:
            RaceError: a race found at an earlier free is pending.
        """
        _raise_deferred()
        other = _as_stream(stream)
        with _lock:
            _counters.stream_waits += 1
            if other is self:
                return
            ready = self._order_after(dict(other._clock), other._busy_until)
        _sleep_until(ready)

    def _order_after(self, clock: dict[int, int], ready: float) -> float:
        """Merge ``clock`` into this stream's; return when the host must wake (lock held)."""
        _merge(self._clock, clock)
        if self._sid == 0:
            return ready
        self._busy_until = max(self._busy_until, ready)
        return 0.0

    def record_event(self, event: "Event | None" = None) -> "Event":
        """Record ``event`` (a new ``Event`` if None) on this stream and return it.

        Raises:
            RaceError: a race found at an earlier free is pending.
        """
        event = Event() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Block the host until all work queued on this stream is complete.

        Sleeps until the stream's virtual completion time; afterwards all of it (and all
        it waited on) counts as complete for the race detector. Not counted in
        ``synchronizes`` (that counts device-wide ``synchronize()`` only).

        Raises:
            RaceError: a race found at an earlier free is pending.
        """
        _raise_deferred()
        with _lock:
            ready = self._busy_until
            _merge(_done, self._clock)
        _host_settle_point()
        _sleep_until(ready)

    def query(self) -> bool:
        """Whether all work queued on this stream is complete (by virtual time).

        True marks that work complete for the race detector, as the host then knows it is.
        """
        with _lock:
            if time.perf_counter() < self._busy_until:
                return False
            _merge(_done, self._clock)
        _host_settle_point()
        return True

    def __enter__(self) -> "Stream":
        _push_stream(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _pop_stream()


def _push_stream(s: "Stream | None") -> None:
    stack = _tls.__dict__.setdefault("stack", [])
    stack.append(getattr(_tls, "stream", None))
    if s is not None:
        _tls.stream = s


def _pop_stream() -> None:
    _tls.stream = _tls.stack.pop()


class Event:
    """A simulated event of the ``fakegpu`` device, shaped like ``torch.cuda.Event``.

    ``record`` snapshots the recording stream's vector clock (and, with
    ``set_copy_bandwidth``, the virtual time its queued work completes); a stream that
    waits on the event is then ordered after all of it.

    Args:
        enable_timing: allow ``elapsed_time`` (virtual milliseconds).
        blocking, interprocess: accepted for ``torch.cuda`` compatibility; ignored.
    """

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._clock: dict[int, int] | None = None
        self._ready = 0.0
        self._sid: int | None = None

    def __repr__(self) -> str:
        where = "not recorded" if self._sid is None else f"recorded on {_sname(self._sid)}"
        return f"<{DEVICE_TYPE} Event {where}>"

    def record(self, stream: Stream | None = None) -> None:
        """Record the event on ``stream`` (None: the current stream). Counts one ``events``.

        Raises:
            RaceError: a race found at an earlier free is pending.
            ValueError, TypeError: ``stream`` is not a fakegpu stream.
        """
        _raise_deferred()
        s = _current() if stream is None else _as_stream(stream)
        with _lock:
            self._clock = dict(s._clock)
            self._sid = s._sid
            self._ready = max(time.perf_counter(), s._busy_until)
            _counters.events += 1

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (None: the current stream) wait for this event (``wait_event``)."""
        (_current() if stream is None else _as_stream(stream)).wait_event(self)

    def synchronize(self) -> None:
        """Block the host until the recorded work is complete (no-op if never recorded).

        Raises:
            RaceError: a race found at an earlier free is pending.
        """
        _raise_deferred()
        if self._clock is None:
            return
        with _lock:
            _merge(_done, self._clock)
        _host_settle_point()
        _sleep_until(self._ready)

    def query(self) -> bool:
        """Whether the recorded work is complete (by virtual time); True if never recorded.

        True marks that work complete for the race detector.
        """
        if self._clock is None:
            return True
        with _lock:
            if time.perf_counter() < self._ready:
                return False
            _merge(_done, self._clock)
        _host_settle_point()
        return True

    def elapsed_time(self, end_event: "Event") -> float:
        """Virtual milliseconds between this event's and ``end_event``'s completion.

        Raises:
            RuntimeError: either event lacks ``enable_timing`` or was never recorded.
        """
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True")
        if self._clock is None or end_event._clock is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        return (end_event._ready - self._ready) * 1000.0


class StreamContext:
    """``with stream(s):`` makes ``s`` the current stream of this thread (None: no change)."""

    def __init__(self, stream: Stream | None) -> None:
        self.stream = None if stream is None else _as_stream(stream)

    def __enter__(self) -> Stream | None:
        _push_stream(self.stream)
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        _pop_stream()


def stream(s: Stream | None) -> StreamContext:
    """Context manager making ``s`` the current stream of this thread, as ``torch.cuda.stream``.

    ``None`` leaves the current stream unchanged. Ops dispatched inside run on ``s``.

    Raises:
        TypeError, ValueError: ``s`` is not a fakegpu stream.
    """
    return StreamContext(s)


def current_stream(device: Any = None) -> Stream:
    """The current stream of this thread: the default stream (id 0) unless inside ``stream(s)``.

    Raises:
        ValueError: ``device`` is not the fake device.
        RuntimeError: ``install()`` has not run.
    """
    _check_device(device)
    _require_installed()
    return _current()


def default_stream(device: Any = None) -> Stream:
    """The default stream (id 0).

    Raises:
        ValueError: ``device`` is not the fake device.
        RuntimeError: ``install()`` has not run.
    """
    _check_device(device)
    _require_installed()
    return _default_stream  # type: ignore[return-value]


def set_stream(s: Stream | None) -> None:
    """Make ``s`` the current stream of this thread (``torch.cuda.set_stream``; None: no-op).

    Raises:
        TypeError, ValueError: ``s`` is not a fakegpu stream.
    """
    if s is not None:
        _tls.stream = _as_stream(s)


def set_copy_bandwidth(bytes_per_second: float | None) -> None:
    """Give host<->device copies a duration of ``nbytes / bytes_per_second`` seconds.

    ``None`` (the default) makes copies instantaneous. With a bandwidth, each stream has
    a virtual completion time: a ``non_blocking`` copy on a side stream returns at once
    and completes at ``max(now, stream busy) + duration``; a blocking copy, or any copy
    on the default stream, sleeps the host until it completes; waits and synchronizes
    sleep until the awaited work completes. Compute takes its real CPU time, so
    prefetching on a side stream overlaps copies with compute in wall-clock time.

    Raises:
        TypeError: not a number or None.
        ValueError: not finite and > 0.
    """
    global _bandwidth, _model_on
    if bytes_per_second is not None:
        if isinstance(bytes_per_second, bool) or not isinstance(bytes_per_second, (int, float)):
            raise TypeError(f"bandwidth must be bytes per second or None, got {bytes_per_second!r}")
        if not math.isfinite(bytes_per_second) or bytes_per_second <= 0:
            raise ValueError(f"bandwidth must be finite and > 0 bytes/s, got {bytes_per_second}")
    with _lock:
        _bandwidth = None if bytes_per_second is None else float(bytes_per_second)
        _model_on = _bandwidth is not None or len(_streams) > 1


def _op_kind(func: Any) -> Any:
    """None for an op that touches no data (views, metadata, allocation); else the
    (positional indices, keyword names) of the arguments it writes and the op's name."""
    kind = _op_kinds.get(func, _MISSING)
    if kind is _MISSING:
        schema = func._schema
        name = schema.name.split("::")[-1]
        if name in _NO_ACCESS or (_returns_alias(func) and not schema.is_mutable):
            kind = None
        else:
            written = [
                (i, a)
                for i, a in enumerate(schema.arguments)
                if a.alias_info is not None and a.alias_info.is_write
            ]
            kind = (
                frozenset(i for i, a in written if not a.kwarg_only),
                frozenset(a.name for _, a in written),
                str(func),
            )
        _op_kinds[func] = kind
    return kind


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
    if _deferred:
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


def _begin_op(T: Stream, accesses: list, op: str) -> int:
    """Check ``accesses`` ((tensor, writes?) pairs) of one op on ``T`` against the other
    streams, then give the op ``T``'s next seq and note the uses.

    Raises:
        RaceError: an access is not ordered after conflicting work on another stream.
    """
    sid = T._sid
    with _lock:
        seq = T._clock[sid] + 1
        if _tracked or sid != 0:
            noted = []
            for x, write in accesses:
                key = x._inner.untyped_storage()._cdata
                st = _tracked.get(key)
                if st is None:
                    if sid == 0:
                        continue  # only ever used on the default stream: untracked
                    st = _tracked[key] = _StorageUse(0, x._inner.shape, x.dtype)
                else:
                    msg = _conflict(st, T, x, write, op, seq)
                    if msg is not None:
                        _counters.races_detected += 1
                        raise RaceError(msg)
                noted.append((st, write))
            for st, write in noted:
                st.uses[sid] = (seq, op)
                if write:
                    st.writes[sid] = (seq, op)
        T._clock[sid] = seq
        return seq


def _conflict(st: _StorageUse, T: Stream, x: torch.Tensor, write: bool, op: str, seq: int):
    """The race message if ``op`` (seq ``seq`` on ``T``) accessing ``x`` races, else None."""
    sid, clock = T._sid, T._clock
    what = f"fakegpu race on a tensor of shape {tuple(x.shape)}, dtype {x.dtype}"
    if tuple(x.shape) != st.shape:
        what += f" (a view of one allocated with shape {st.shape})"
    what += ": "
    for u, (w, wop) in st.writes.items():
        if u != sid and w > max(clock.get(u, 0), _done.get(u, 0)):
            return (
                f"{what}{_sname(u)} {wop} (seq {w}) is still pending, "
                f"{'written' if write else 'read'} by {op} on {_sname(sid)} (seq {seq}) "
                f"without an event wait (wait_event/wait_stream) or synchronize ordering it "
                f"after that work"
            )
    if write:
        for u, (r, rop) in st.uses.items():
            if u != sid and r > max(clock.get(u, 0), _done.get(u, 0)):
                return (
                    f"{what}{_sname(u)} {rop} (seq {r}) may still be using it, "
                    f"written by {op} on {_sname(sid)} (seq {seq}) without an event wait "
                    f"(wait_event/wait_stream) or synchronize ordering it after that use"
                )
    return None


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


def _after_transfer(T: Stream, nbytes: int, non_blocking: bool) -> None:
    """Timing and completion of a host<->device copy just issued on ``T``."""
    bandwidth = _bandwidth
    with _lock:
        now = time.perf_counter()
        duration = nbytes / bandwidth if bandwidth else 0.0
        start = max(now, T._busy_until)
        T._busy_until = start + duration
        if T._sid != 0 and non_blocking:
            return  # pending: the host goes on
        if not non_blocking:  # the host waits for the stream up to this copy
            _merge(_done, T._clock)
            if _host_pending:
                _prune_host()
        end = T._busy_until
    _sleep_until(end)


def _record_stream(t: torch.Tensor, s: Any) -> None:
    """``aten::record_stream``: uses of ``t`` on ``s`` no longer make freeing ``t`` a race
    (the caching allocator would defer reuse of the memory until that work completes)."""
    if not isinstance(t, FakeDeviceTensor):
        raise TypeError(f"record_stream takes a {DEVICE_TYPE} tensor, got one on {t.device}")
    if _deferred:
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


def _note_allocation(key: int, inner: torch.Tensor) -> None:
    """A new storage allocated while a side stream is current belongs to that stream
    (lock held)."""
    T = _current()
    if T is not None and T._sid != 0:
        st = _tracked[key] = _StorageUse(T._sid, inner.shape, inner.dtype)
        st.uses[T._sid] = (T._clock[T._sid], "allocation")


def _note_kernel_write(out: torch.Tensor, op: str) -> None:
    """A factory kernel outside ``__torch_dispatch__`` wrote ``out`` on the current stream."""
    if _model_on:
        _begin_op(_current(), [(out, True)], op)


def _check_free(st: _StorageUse) -> None:
    """Record a race if a storage is freed before its uses on other streams are ordered
    before its allocation stream's later work (lock held; raised later: frees happen in
    finalizers, where an exception cannot propagate)."""
    alloc = _streams.get(st.alloc)
    clock = alloc._clock if alloc is not None else {}
    for u, (seq, op) in st.uses.items():
        if u == st.alloc or u in st.recorded:
            continue
        if seq > max(clock.get(u, 0), _done.get(u, 0)):
            _counters.races_detected += 1
            _deferred.append(
                f"fakegpu race: a tensor of shape {st.shape}, dtype {st.dtype}, allocated on "
                f"{_sname(st.alloc)} was freed while {op} on {_sname(u)} (seq {seq}) may "
                f"still be using it: {_sname(st.alloc)} had not waited on {_sname(u)} past "
                f"that use (wait_event/wait_stream), no synchronize covered it, and "
                f"tensor.record_stream() was not called with {_sname(u)} (found at the "
                f"free, raised at the next fakegpu call)"
            )
            return


# ----------------------------------------------------------------------------- host side
#
# The host is a participant of the vector clock model: ``_done`` is its clock (per stream,
# the highest seq it knows complete). A non-blocking copy between the device and a pinned
# host storage is noted in ``_host_pending`` (keyed by the storage's data pointer, like
# ``_counters.pinned``) until the host's clock covers it; only such storages are looked
# up, so an op on any other tensor costs one dict lookup per tensor argument. Host ops
# are seen by ``_HostAccessMode``, pushed by ``install()`` (and on another thread at its
# first pinned copy) and never popped (see ``_ensure_host_mode``).

_TRANSFER_OPS = frozenset(
    {_aten.copy_.default, _aten._to_copy.default, _aten._local_scalar_dense.default}
)
_HOST_WAITS = (
    "the host had not waited for it (Event.synchronize, Stream.synchronize, "
    "synchronize(), or a blocking copy/.item()/.cpu() on a stream ordered after it)"
)


class _HostUse:
    """Pending non-blocking copies from or into one pinned host storage."""

    __slots__ = ("reads", "writes")

    def __init__(self) -> None:
        self.reads: dict[int, tuple[int, str]] = {}  # stream id -> (seq, op): copies reading it
        self.writes: dict[int, tuple[int, str]] = {}  # stream id -> (seq, op): copies into it


_host_pending: dict[int, _HostUse] = {}  # host storage data_ptr -> its pending copies
_host_watched: set[int] = set()  # storages whose free forgets their entry (one finalizer each)
_fake_types: dict[type, bool] = {}  # tensor type -> dispatches as FakeDeviceTensor


def _host_key(t: torch.Tensor) -> int:
    """The data pointer of host tensor ``t``'s storage (0: none, e.g. sparse or meta)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


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


def _host_begin(T: "Stream", host: Any, write: bool, non_blocking: bool, op: str):
    """Check the host side of a copy about to run on ``T``: returns (whether ``host`` is
    pinned, the effective non_blocking: a copy into pageable memory completes before it
    returns, as on CUDA).

    Raises:
        RaceError: the copy races a pending copy from or into the same host storage.
    """
    if host is None:
        return False, non_blocking
    key = _host_key(host)
    if key in _host_pending:
        _host_check(host, write, op, T, key)
    pinned = non_blocking and key != 0 and key in _counters.pinned
    if non_blocking and write and not pinned:
        non_blocking = False
    return pinned, non_blocking


def _host_conflict(e: _HostUse, x: torch.Tensor, write: bool, op: str, T: "Stream | None"):
    """The race message if accessing ``x`` (``T``: by a copy on that stream; None: by the
    host) races a pending copy of ``e``; else None (lock held)."""
    sid = None if T is None else T._sid
    clock = None if T is None else T._clock

    def known(u: int) -> int:
        k = _done.get(u, 0)
        return k if clock is None else max(k, clock.get(u, 0))

    what = f"fakegpu race on a pinned host tensor of shape {tuple(x.shape)}, dtype {x.dtype}: "
    if T is None:
        who, why = "on the host", _HOST_WAITS
    else:
        who = f"on {_sname(sid)}"
        why = "no event wait (wait_event/wait_stream) or synchronize ordered it after that copy"
    for u, (w, wop) in e.writes.items():
        if u != sid and w > known(u):
            return (
                f"{what}{_sname(u)} {wop} (seq {w}) into it is still pending, "
                f"{'written' if write else 'read'} by {op} {who}: {why}"
            )
    if write:
        for u, (r, rop) in e.reads.items():
            if u != sid and r > known(u):
                return (
                    f"{what}{_sname(u)} {rop} (seq {r}) may still be reading it, written by "
                    f"{op} {who}: {why}"
                )
    return None


def _host_settled(e: _HostUse) -> bool:
    """Whether the host knows every copy of ``e`` complete (lock held)."""
    for d in (e.writes, e.reads):
        for u, (seq, _) in d.items():
            if seq > _done.get(u, 0):
                return False
    return True


def _prune_host() -> None:
    """Forget the pending copies the host now knows complete (lock held)."""
    # a copy first: a finalizer run by the garbage collector may forget an entry meanwhile
    for key, e in _host_pending.copy().items():
        if _host_settled(e):
            _host_pending.pop(key, None)


def _host_check(
    x: torch.Tensor, write: bool, op: str, T: "Stream | None" = None, key: int | None = None
) -> None:
    """Raise ``RaceError`` if ``op`` reading (or writing) host tensor ``x`` races a pending
    copy from or into its storage; ``T``: the stream of a copy, None for a host op;
    ``key``: ``_host_key(x)`` when the caller has it.

    Raises:
        RaceError: see above.
    """
    if key is None:
        key = _host_key(x)
    if key not in _host_pending:
        return
    with _lock:
        e = _host_pending.get(key)
        if e is None:
            return
        msg = _host_conflict(e, x, write, op, T)
        if msg is None:
            if _host_settled(e):
                del _host_pending[key]
            return
        _counters.races_detected += 1
    raise RaceError(msg)


def _host_forget(key: int) -> None:
    with _lock:
        _host_pending.pop(key, None)
        _host_watched.discard(key)


def _host_note(T: "Stream", seq: int, x: torch.Tensor, write: bool, op: str = "") -> None:
    """Note a non-blocking copy (seq ``seq`` on ``T``) reading or writing pinned host
    tensor ``x``: pending for the host until its clock covers ``seq``."""
    key = _host_key(x)
    if key == 0:
        return
    with _lock:
        e = _host_pending.get(key)
        if e is None:
            e = _host_pending[key] = _HostUse()
        if write:
            e.writes[T._sid] = (seq, "device-to-host copy")
        else:
            e.reads[T._sid] = (seq, "host-to-device copy")
        if key not in _host_watched:
            _host_watched.add(key)
            weakref.finalize(x.untyped_storage(), _host_forget, key)
    _ensure_host_mode()


def _is_fake_type(t: type) -> bool:
    r = _fake_types.get(t)
    if r is None:
        r = _fake_types[t] = isinstance(t, type) and issubclass(t, FakeDeviceTensor)
    return r


def _check_host_op(func, args, kwargs) -> None:
    """Raise ``RaceError`` if a host op (no ``fakegpu`` tensor) touches a host storage
    that a pending copy writes, or writes one that a pending copy reads.

    One storage lookup per tensor argument; the op's schema is read only on a hit.

    Raises:
        RaceError: as above.
    """
    pending = _host_pending
    hit = False
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            if isinstance(a, FakeDeviceTensor):
                return  # a device op: its host arguments are checked as copies on its stream
            if _host_key(a) in pending:
                hit = True
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    if isinstance(b, FakeDeviceTensor):
                        return
                    if _host_key(b) in pending:
                        hit = True
    if not hit:
        return
    kind = _op_kind(func)
    if kind is None or _device_kwarg_is_fake(kwargs):
        return  # no data access; or a copy to the device (checked as a copy on its stream)
    pos, names, op = kind
    for i, a in enumerate(args):
        for b in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(b, torch.Tensor) and b.is_cpu:
                _host_check(b, i in pos, op)
    for k, v in kwargs.items():
        for b in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(b, torch.Tensor) and b.is_cpu:
                _host_check(b, k in names, op)


def _device_kwarg_is_fake(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == DEVICE_TYPE


class _HostAccessMode(TorchDispatchMode):
    """Sees the host ops of the thread it is pushed on, while host copies are pending.

    An op on ``fakegpu`` tensors goes straight to their dispatch (no second trip through
    the dispatcher); any other op is checked against the pending copies, then run, or
    raises ``RaceError`` (see ``_check_host_op``). Ignored by ``torch.compile`` while
    compiling (it runs for the compiled code).
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if kwargs is None:
            kwargs = {}
        if types and all(_is_fake_type(t) for t in types):
            return _dispatch(func, args, kwargs)
        if _host_pending:
            _check_host_op(func, args, kwargs)
        return func(*args, **kwargs)


def _ensure_host_mode() -> None:
    """Push ``_HostAccessMode`` on this thread if it is not there yet; it stays for good.

    ``install()`` pushes it on the installing thread, at the bottom of the stack; another
    thread gets it at its first pinned copy. It is never popped: a pop inside a context
    that restores the thread's dispatch key set on exit (``torch.inference_mode``,
    ``no_grad``, a subclass's ``__torch_dispatch__``) would leave the Python dispatch
    key enabled over an empty mode stack, which breaks every later factory call. Not
    pushed over another active dispatch mode (leaving that mode's ``__exit__`` its own
    stack): that thread's host ops are then unchecked."""
    if getattr(_tls, "host_mode", None) is not None:
        return
    if torch._C._len_torch_dispatch_stack():
        return
    mode = _HostAccessMode()
    torch._C._push_on_torch_dispatch_stack(mode)
    _tls.host_mode = mode


def _host_settle_point() -> None:
    """After the host's clock advanced outside an op: forget what completed."""
    if _host_pending:
        with _lock:
            _prune_host()


def _blocking_device_read(x: FakeDeviceTensor, op: str) -> None:
    """A blocking host read of ``x`` on the current stream (``repr``): checked like an op,
    then the host knows that stream's work complete.

    Raises:
        RaceError: ``x``'s last writer on another stream is not ordered before it.
    """
    T = _current()
    _begin_op(T, [(x, False)], op)
    with _lock:
        _merge(_done, T._clock)
        if _host_pending:
            _prune_host()


_TENSOR_REPR = torch.Tensor.__repr__
_TENSOR_TOLIST = torch.Tensor.tolist


@torch.compiler.disable
def _host_repr(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
    """``Tensor.__repr__`` (installed by ``install``): printing a host tensor reads it,
    outside the dispatcher's view (torch disables dispatch modes while printing).

    Raises:
        RaceError: a pending device-to-host copy into it is not known complete.
    """
    if _host_pending and self.is_cpu:
        _host_check(self, False, "repr() (host read)")
    return _TENSOR_REPR(self, *args, **kwargs)


@torch.compiler.disable
def _host_tolist(self: torch.Tensor) -> Any:
    """``Tensor.tolist`` (installed by ``install``), which reads host memory directly.

    Raises:
        RaceError: a pending device-to-host copy into it is not known complete.
    """
    if _host_pending and self.is_cpu:
        _host_check(self, False, "tolist() (host read)")
    return _TENSOR_TOLIST(self)


class _BackendModule:
    """The ``torch.fakegpu`` module: what PyTorch expects of a device backend module."""

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return 1

    Stream = Stream
    Event = Event
    StreamContext = StreamContext
    RaceError = RaceError

    @staticmethod
    def synchronize(device: Any = None) -> None:
        synchronize()

    @staticmethod
    def current_stream(device: Any = None) -> Stream:
        return current_stream(device)

    @staticmethod
    def default_stream(device: Any = None) -> Stream:
        return default_stream(device)

    @staticmethod
    def stream(s: Stream | None) -> StreamContext:
        return stream(s)

    @staticmethod
    def set_stream(s: Stream) -> None:
        set_stream(s)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return stats()["allocated_bytes"]

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return stats()["peak_bytes"]

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        s = stats()
        total = s["capacity"] if s["capacity"] >= 0 else _UNLIMITED_TOTAL
        return max(total - s["allocated_bytes"], 0), total

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        reset_peak()

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def host_register(ptr: int, nbytes: int) -> bool:
        """Simulated ``cudaHostRegister``: the storage at ``ptr`` now reports ``is_pinned()``."""
        with _lock:
            if ptr in _counters.pinned:
                return False  # CUDA: cudaErrorHostMemoryAlreadyRegistered
            _counters.pinned.add(ptr)
        return True

    @staticmethod
    def host_unregister(ptr: int) -> None:
        """Simulated ``cudaHostUnregister``."""
        _unpin(ptr)


# ----------------------------------------------------------------------------- public API


def install() -> torch.device:
    """Register the ``fakegpu`` device (idempotent) and return ``torch.device("fakegpu:0")``.

    Raises:
        RuntimeError: PrivateUse1 is already registered under another name in this
            process (PyTorch allows one rename per process).
    """
    global _installed, _DEVICE
    with _lock:
        if _installed:
            return _DEVICE
        current = torch._C._get_privateuse1_backend_name()
        if current not in ("privateuseone", DEVICE_TYPE):
            raise RuntimeError(
                f"PrivateUse1 is already registered as {current!r}; the fake accelerator "
                f"needs it as {DEVICE_TYPE!r} and PyTorch allows one name per process"
            )
        from torch.utils.backend_registration import (
            _setup_privateuseone_for_python_backend,
        )

        if current != DEVICE_TYPE:
            _setup_privateuseone_for_python_backend(
                DEVICE_TYPE, backend_module=_BackendModule()
            )
        _DEVICE = torch.device(DEVICE_TYPE, 0)
        global _default_stream
        if _default_stream is None:
            _default_stream = Stream._make(0)
        dev_lib = torch.library.Library("aten", "IMPL", "PrivateUse1")
        dev_lib.impl("empty.memory_format", _empty_memory_format)
        dev_lib.impl("empty_strided", _empty_strided)
        dev_lib.impl("_copy_from", _copy_from)
        dev_lib.impl("arange", _arange_end)
        dev_lib.impl("arange.start", _arange)
        dev_lib.impl("arange.start_step", _arange)
        dev_lib.impl("linspace", _linspace)
        cpu_lib = torch.library.Library("aten", "IMPL", "CPU")
        cpu_lib.impl("_pin_memory", _pin_memory)
        cpu_lib.impl("is_pinned", _is_pinned)
        _libs.extend([dev_lib, cpu_lib])
        torch.Tensor.data = property(_data_get, _data_set)  # type: ignore[assignment]
        torch.Tensor.__repr__ = _host_repr  # type: ignore[method-assign]
        torch.Tensor.tolist = _host_tolist  # type: ignore[method-assign]
        _installed = True
        _ensure_host_mode()  # at the bottom of this thread's mode stack, for good
        return _DEVICE


def is_installed() -> bool:
    """Whether ``install()`` has run in this process."""
    return _installed


def stats() -> dict[str, int]:
    """Counters of the fake device.

    Returns:
        ``allocated_bytes`` (bytes of live device storages), ``peak_bytes`` (maximum of
        ``allocated_bytes`` since the last ``reset_stats``), ``h2d_bytes`` and ``d2h_bytes``
        (bytes copied host->device and device->host), ``transfers`` (tensor copies between
        host and device), ``synchronizes`` (calls to the device-wide ``synchronize``),
        ``stream_waits`` (calls of ``Stream.wait_event``/``wait_stream``/``Event.wait``),
        ``events`` (``Event.record`` calls, ``Stream.record_event`` included),
        ``races_detected`` (races found, raised or pending), ``capacity`` (bytes, or -1
        for unlimited).
    """
    with _lock:
        return {
            "allocated_bytes": _counters.allocated_bytes,
            "peak_bytes": _counters.peak_bytes,
            "h2d_bytes": _counters.h2d_bytes,
            "d2h_bytes": _counters.d2h_bytes,
            "transfers": _counters.transfers,
            "synchronizes": _counters.synchronizes,
            "stream_waits": _counters.stream_waits,
            "events": _counters.events,
            "races_detected": _counters.races_detected,
            "capacity": -1 if _counters.capacity is None else _counters.capacity,
        }


def live_storages() -> dict[int, int]:
    """The device storages alive now: ``{storage key: nbytes}``.

    The key is ``tensor._inner.untyped_storage()._cdata`` of any ``fakegpu`` tensor
    viewing it (``storage_key``). Tests use it to prove that exactly a given set of
    tensors is resident: nothing else allocated is left behind.
    """
    with _lock:
        return {k: v[1] for k, v in _counters.storages.items()}


def storage_key(t: torch.Tensor) -> int:
    """The key of ``live_storages`` for the ``fakegpu`` tensor ``t``.

    Raises:
        TypeError: ``t`` is not on the fake device.
    """
    if not isinstance(t, FakeDeviceTensor):
        raise TypeError(f"storage_key takes a {DEVICE_TYPE} tensor, got one on {t.device}")
    return t._inner.untyped_storage()._cdata


def reset_stats() -> None:
    """Zero the transfer, synchronize, stream-wait, event and race counters;
    ``peak_bytes`` := ``allocated_bytes``.

    Races found at frees and not yet raised are dropped too (the ``fake_device`` test
    fixture calls this first, so a race left by an earlier test does not fail the next).
    Stream ordering state (what each stream has waited on, the copies still pending for
    the host) is kept.
    """
    with _lock:
        _counters.peak_bytes = _counters.allocated_bytes
        _counters.h2d_bytes = 0
        _counters.d2h_bytes = 0
        _counters.transfers = 0
        _counters.synchronizes = 0
        _counters.stream_waits = 0
        _counters.events = 0
        _counters.races_detected = 0
        _deferred.clear()


def reset_peak() -> None:
    """Make ``peak_bytes`` equal to ``allocated_bytes``; other counters are kept."""
    with _lock:
        _counters.peak_bytes = _counters.allocated_bytes


def set_capacity(nbytes: int | None) -> None:
    """Limit device memory to ``nbytes`` bytes (``None``: unlimited).

    An allocation that would take ``allocated_bytes`` above the capacity raises
    ``torch.OutOfMemoryError``. Already allocated memory is not affected.

    Raises:
        TypeError: ``nbytes`` is not an int or None.
        ValueError: ``nbytes`` is negative.
    """
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool)):
        raise TypeError(f"capacity must be an int number of bytes or None, got {nbytes!r}")
    if nbytes is not None and nbytes < 0:
        raise ValueError(f"capacity must be >= 0 bytes, got {nbytes}")
    with _lock:
        _counters.capacity = nbytes


def synchronize() -> None:
    """Block the host until all work on every stream completes; counts one ``synchronizes``.

    With ``set_copy_bandwidth``, sleeps until the last queued copy's virtual completion.
    Afterwards no work is pending for the race detector.

    Raises:
        RaceError: a race found at a free since the last fakegpu call (after completing).
    """
    with _lock:
        _counters.synchronizes += 1
        ready = 0.0
        for s in _streams.values():
            _merge(_done, s._clock)
            ready = max(ready, s._busy_until)
    _host_settle_point()
    _sleep_until(ready)
    _raise_deferred()
