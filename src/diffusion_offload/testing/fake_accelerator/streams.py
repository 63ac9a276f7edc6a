"""Streams and events of the fake device, shaped like ``torch.cuda``'s: ``Stream``,
``Event``, ``StreamContext``, the current/default/set stream of a thread, the
device-wide ``synchronize()`` and the copy bandwidth.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .counters import _counters
from .host_races import _host_settle_point
from .races import _done, _merge, _raise_deferred, _sleep_until, _sname
from .state import DEVICE_TYPE, _current, _lock, state

_PRIVATEUSE1 = int(torch._C._autograd.DeviceType.PrivateUse1)


def _require_installed() -> None:
    if state.default_stream is None:
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


def _as_stream(s: Any) -> "Stream":
    """Our ``Stream`` for ``s`` (a ``Stream`` or a ``torch.Stream`` naming a fakegpu stream)."""
    if isinstance(s, Stream):
        return s
    if isinstance(s, torch.Stream):
        if s.device_type == _PRIVATEUSE1 and s.stream_id in state.streams:
            return state.streams[s.stream_id]
        raise ValueError(f"not a {DEVICE_TYPE} stream: {s!r}")
    raise TypeError(f"expected a {DEVICE_TYPE} Stream, got {type(s).__name__}")


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
                existing = state.streams.get(kwargs["stream_id"])
                if existing is None:
                    raise ValueError(f"no {DEVICE_TYPE} stream with id {kwargs['stream_id']}")
                return existing
            return cls._make(len(state.streams), priority)

    @classmethod
    def _make(cls, sid: int, priority: int = 0) -> "Stream":
        """The stream with id ``sid`` (0: the default stream, made by ``install``)."""
        self = torch.Stream.__new__(cls, stream_id=sid, device_type=_PRIVATEUSE1, device_index=0)
        self._sid = sid
        self.priority = priority
        self._clock = {sid: 0}
        self._busy_until = 0.0
        state.streams[sid] = self
        if sid != 0:
            state.model_on = True
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
        it waited on) counts as complete for the race detector. Counts one
        ``host_waits``; not counted in ``synchronizes`` (that counts device-wide
        ``synchronize()`` only).

        Raises:
            RaceError: a race found at an earlier free is pending.
        """
        _raise_deferred()
        with _lock:
            _counters.host_waits += 1
            ready = self._busy_until
            _merge(_done, self._clock)
        _host_settle_point()
        _sleep_until(ready)

    def query(self) -> bool:
        """Whether all work queued on this stream is complete (by virtual time).

        True marks that work complete for the race detector, as the host then knows it is.
        Counts one ``host_waits`` whatever it returns (a call the host makes to learn the
        device's progress).
        """
        with _lock:
            _counters.host_waits += 1
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
    stack = state.tls.__dict__.setdefault("stack", [])
    stack.append(getattr(state.tls, "stream", None))
    if s is not None:
        state.tls.stream = s


def _pop_stream() -> None:
    state.tls.stream = state.tls.stack.pop()


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

        Counts one ``host_waits`` (also for an event never recorded).

        Raises:
            RaceError: a race found at an earlier free is pending.
        """
        _raise_deferred()
        with _lock:
            _counters.host_waits += 1
            if self._clock is None:
                return
            _merge(_done, self._clock)
        _host_settle_point()
        _sleep_until(self._ready)

    def query(self) -> bool:
        """Whether the recorded work is complete (by virtual time); True if never recorded.

        True marks that work complete for the race detector. Counts one ``host_waits``
        whatever it returns (also for an event never recorded).
        """
        with _lock:
            _counters.host_waits += 1
            if self._clock is None:
                return True
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
    return state.default_stream  # type: ignore[return-value]


def set_stream(s: Stream | None) -> None:
    """Make ``s`` the current stream of this thread (``torch.cuda.set_stream``; None: no-op).

    Raises:
        TypeError, ValueError: ``s`` is not a fakegpu stream.
    """
    if s is not None:
        state.tls.stream = _as_stream(s)


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
    if bytes_per_second is not None:
        if isinstance(bytes_per_second, bool) or not isinstance(bytes_per_second, (int, float)):
            raise TypeError(f"bandwidth must be bytes per second or None, got {bytes_per_second!r}")
        if not math.isfinite(bytes_per_second) or bytes_per_second <= 0:
            raise ValueError(f"bandwidth must be finite and > 0 bytes/s, got {bytes_per_second}")
    with _lock:
        state.bandwidth = None if bytes_per_second is None else float(bytes_per_second)
        state.model_on = state.bandwidth is not None or len(state.streams) > 1


def synchronize() -> None:
    """Block the host until all work on every stream completes; counts one ``synchronizes``
    and one ``host_waits``.

    With ``set_copy_bandwidth``, sleeps until the last queued copy's virtual completion.
    Afterwards no work is pending for the race detector.

    Raises:
        RaceError: a race found at a free since the last fakegpu call (after completing).
    """
    with _lock:
        _counters.synchronizes += 1
        _counters.host_waits += 1
        ready = 0.0
        for s in state.streams.values():
            _merge(_done, s._clock)
            ready = max(ready, s._busy_until)
    _host_settle_point()
    _sleep_until(ready)
    _raise_deferred()
