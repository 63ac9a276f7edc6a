"""The host-side race detector, on pinned host memory: which host storages are pinned,
the non-blocking copies still pending for the host (``_host_pending``), the checks of
copies and of host ops against them (the host dispatch mode ``_HostAccessMode``, and the
``Tensor.__repr__``/``tolist`` that ``install()`` puts in place), blocking host reads of
device tensors (``repr()``), and the timing and completion of a host<->device copy
(``_after_transfer``).

The host dispatch mode hands ops on ``fakegpu`` tensors to the device's dispatch:
``device.py``, above this module, registers its tensor class and dispatch function as
``state.tensor_type`` and ``state.dispatch`` when it is imported.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .counters import _counters
from .races import RaceError, _begin_op, _done, _merge, _op_kind, _sleep_until, _sname
from .state import DEVICE_TYPE, _current, _lock, state

# The host is a participant of the vector clock model: ``_done`` is its clock (per stream,
# the highest seq it knows complete). A non-blocking copy between the device and a pinned
# host storage is noted in ``_host_pending`` (keyed by the storage's data pointer, like
# ``_counters.pinned``) until the host's clock covers it; only such storages are looked
# up, so an op on any other tensor costs one dict lookup per tensor argument. Host ops
# are seen by ``_HostAccessMode``, pushed by ``install()`` (and on another thread at its
# first pinned copy) and never popped (see ``_ensure_host_mode``).

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


def _host_begin(T: torch.Stream, host: Any, write: bool, non_blocking: bool, op: str):
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


def _host_conflict(e: _HostUse, x: torch.Tensor, write: bool, op: str, T: torch.Stream | None):
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
    x: torch.Tensor, write: bool, op: str, T: torch.Stream | None = None, key: int | None = None
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


def _host_note(T: torch.Stream, seq: int, x: torch.Tensor, write: bool, op: str = "") -> None:
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
        r = _fake_types[t] = isinstance(t, type) and issubclass(t, state.tensor_type)
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
            if isinstance(a, state.tensor_type):
                return  # a device op: its host arguments are checked as copies on its stream
            if _host_key(a) in pending:
                hit = True
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    if isinstance(b, state.tensor_type):
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
            return state.dispatch(func, args, kwargs)
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
    if getattr(state.tls, "host_mode", None) is not None:
        return
    if torch._C._len_torch_dispatch_stack():
        return
    mode = _HostAccessMode()
    torch._C._push_on_torch_dispatch_stack(mode)
    state.tls.host_mode = mode


def _host_settle_point() -> None:
    """After the host's clock advanced outside an op: forget what completed."""
    if _host_pending:
        with _lock:
            _prune_host()


def _blocking_device_read(x: torch.Tensor, op: str) -> None:
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


def _mark_pinned(t: torch.Tensor) -> None:
    """Remember the host storage of ``t`` as pinned until that storage is freed: a block of
    CUDA's caching host allocator (``pin_memory()``, the result of a non-blocking copy to
    the host), so it holds the storage's bytes rounded up to a power of two
    (``aten/src/ATen/core/CachingHostAllocator.h``, ``allocate``)."""
    storage = t.untyped_storage()
    key = storage.data_ptr()
    nbytes = storage.nbytes()
    with _lock:
        _counters.pinned[key] = 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()
    weakref.finalize(storage, _unpin, key)


def pinned_host_bytes() -> int:
    """Pinned host bytes alive now, as CUDA would hold them: each ``host_register``'s
    bytes, and each caching-allocator block (``pin_memory()``, a non-blocking copy's host
    result) rounded up to a power of two."""
    with _lock:
        return sum(_counters.pinned.values())


def _unpin(key: int) -> None:
    """The storage at ``key`` is pageable again (unregistered or freed): its pending
    copies are no longer tracked."""
    with _lock:
        _counters.pinned.pop(key, None)
        _host_pending.pop(key, None)


def _after_transfer(T: torch.Stream, nbytes: int, non_blocking: bool) -> None:
    """Timing and completion of a host<->device copy just issued on ``T``."""
    bandwidth = state.bandwidth
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
