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

What it cannot simulate: streams, asynchronous copies, allocator caching and
fragmentation. Those exist only on a real GPU (see ``bench/gpu_check.py``).

The device type can be registered once per process; ``install()`` is idempotent and
raises ``RuntimeError`` if PrivateUse1 was already renamed to something else.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "DEVICE_TYPE",
    "FakeDeviceTensor",
    "install",
    "is_installed",
    "live_storages",
    "reset_peak",
    "reset_stats",
    "set_capacity",
    "stats",
    "storage_key",
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

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # noqa: D105
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
    is ``torch.compiler.disable``d: nothing here is traced)."""
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
    return FakeDeviceTensor(torch.arange(start, end, step, dtype=dtype))


@torch.compiler.disable
def _arange_end(end, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten::arange``: see ``_arange``."""
    return FakeDeviceTensor(torch.arange(end, dtype=dtype))


@torch.compiler.disable
def _linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    """``aten::linspace``, built whole for the same reason as ``_arange``."""
    return FakeDeviceTensor(torch.linspace(start, end, steps, dtype=dtype))


def _pin_memory(self: torch.Tensor, device=None) -> torch.Tensor:
    out = torch.empty_like(self, memory_format=torch.preserve_format)
    out.copy_(self)
    key = out.untyped_storage().data_ptr()
    with _lock:
        _counters.pinned.add(key)
    weakref.finalize(out.untyped_storage(), _unpin, key)
    return out


def _unpin(key: int) -> None:
    with _lock:
        _counters.pinned.discard(key)


def _is_pinned(self: torch.Tensor, device=None) -> bool:
    if self.device.type != "cpu":
        return False
    with _lock:
        return self.untyped_storage().data_ptr() in _counters.pinned


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

    @staticmethod
    def synchronize(device: Any = None) -> None:
        synchronize()

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
        _installed = True
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
        host and device), ``synchronizes`` (calls to ``synchronize``), ``capacity`` (bytes,
        or -1 for unlimited).
    """
    with _lock:
        return {
            "allocated_bytes": _counters.allocated_bytes,
            "peak_bytes": _counters.peak_bytes,
            "h2d_bytes": _counters.h2d_bytes,
            "d2h_bytes": _counters.d2h_bytes,
            "transfers": _counters.transfers,
            "synchronizes": _counters.synchronizes,
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
    """Zero the transfer and synchronize counters; ``peak_bytes`` := ``allocated_bytes``."""
    with _lock:
        _counters.peak_bytes = _counters.allocated_bytes
        _counters.h2d_bytes = 0
        _counters.d2h_bytes = 0
        _counters.transfers = 0
        _counters.synchronizes = 0


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
    """Count one device synchronize (all fake-device work is already complete)."""
    with _lock:
        _counters.synchronizes += 1
