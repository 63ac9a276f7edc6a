"""The device-side race detector of the stream model: ``RaceError``, the host's clock
(``_done``: per stream, the highest seq the host knows complete), what each op reads and
writes (``_op_kind``), the uses of tracked device storages by stream (``_tracked``), the
check of an op's accesses against the other streams (``_begin_op``) and of frees
(``_check_free``, raised later by ``_raise_deferred``), and the clock helpers (``_merge``,
``_sleep_until``) that streams and copies share.

Streams are passed in (a ``streams.Stream``, annotated as its base ``torch.Stream``: this
module is below ``streams.py``), and so are device tensors (a ``FakeDeviceTensor``, read
through its ``_inner``: this module is below ``device.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .counters import _counters
from .state import _current, _lock, state


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


_done: dict[int, int] = {}  # stream id -> highest seq the host knows to be complete
_tracked: dict[int, "_StorageUse"] = {}  # storage key -> its uses, by stream
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


def _raise_deferred() -> None:
    """Raise the races found at frees since the last call (they could not raise there)."""
    if not state.deferred:
        return
    with _lock:
        msgs = list(state.deferred)
        state.deferred.clear()
    if msgs:
        more = f" (and {len(msgs) - 1} more race(s) found at frees)" if len(msgs) > 1 else ""
        raise RaceError(msgs[0] + more)


def _returns_alias(func) -> bool:
    return any(r.alias_info is not None for r in func._schema.returns)


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


def _begin_op(T: torch.Stream, accesses: list, op: str) -> int:
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


def _conflict(
    st: _StorageUse, T: torch.Stream, x: torch.Tensor, write: bool, op: str, seq: int
):
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


def _note_allocation(key: int, inner: torch.Tensor) -> None:
    """A new storage allocated while a side stream is current belongs to that stream
    (lock held)."""
    T = _current()
    if T is not None and T._sid != 0:
        st = _tracked[key] = _StorageUse(T._sid, inner.shape, inner.dtype)
        st.uses[T._sid] = (T._clock[T._sid], "allocation")


def _note_kernel_write(out: torch.Tensor, op: str) -> None:
    """A factory kernel outside ``__torch_dispatch__`` wrote ``out`` on the current stream."""
    if state.model_on:
        _begin_op(_current(), [(out, True)], op)


def _check_free(st: _StorageUse) -> None:
    """Record a race if a storage is freed while a use on another stream may still run
    (lock held; raised later: frees happen in finalizers, where an exception cannot
    propagate).

    A use on stream ``u`` (seq ``n``) is safe at the free, as with CUDA's caching
    allocator, when any of these holds: ``u`` is the allocation stream; the allocation
    stream is ordered after it (its clock covers ``u`` up to ``n``); the host knows it
    complete (a synchronize); ``u`` was given to ``tensor.record_stream``; or a stream
    given to ``record_stream`` is ordered after it (that stream's clock covers ``u`` up
    to ``n`` now). The caching allocator records an event on every recorded stream at
    the free and reuses the block only when those events complete, and such an event
    completes only after everything its stream waited on, the use included.
    """
    alloc = state.streams.get(st.alloc)
    clock = alloc._clock if alloc is not None else {}
    for u, (seq, op) in st.uses.items():
        if u == st.alloc or u in st.recorded:
            continue
        if seq <= max(clock.get(u, 0), _done.get(u, 0)):
            continue
        if any(_covers(r, u, seq) for r in st.recorded):
            continue
        _counters.races_detected += 1
        state.deferred.append(
            f"fakegpu race: a tensor of shape {st.shape}, dtype {st.dtype}, allocated on "
            f"{_sname(st.alloc)} was freed while {op} on {_sname(u)} (seq {seq}) may "
            f"still be using it: {_sname(st.alloc)} had not waited on {_sname(u)} past "
            f"that use (wait_event/wait_stream), no synchronize covered it, and "
            f"tensor.record_stream() was called neither with {_sname(u)} nor with a "
            f"stream that had waited on it past that use (found at the free, raised at "
            f"the next fakegpu call)"
        )
        return


def _covers(r: int, u: int, seq: int) -> bool:
    """Whether stream ``r``'s work queued so far is ordered after seq ``seq`` of stream
    ``u`` (lock held)."""
    stream = state.streams.get(r)
    return stream is not None and stream._clock.get(u, 0) >= seq
