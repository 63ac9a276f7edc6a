"""Accounting of the fake device: its counters, ``stats()`` and their resets, the live
device storages and the capacity that allocations are checked against.
"""

from __future__ import annotations

import torch

from .state import _lock, state


#: CUDA's caching allocator serves requests of at most this many bytes from its small
#: pool (``kSmallSize``, 1 MiB); ``memory_stats()`` splits its statistics the same way
SMALL_POOL_MAX_BYTES = 1 << 20
_ALL, _SMALL, _LARGE = 0, 1, 2
_POOL_NAMES = ("all", "small_pool", "large_pool")


class _Stat:
    """One statistic as CUDA's allocator keeps it: its current value, its peak since the
    last peak reset, and the total increase (``allocated``) and decrease (``freed``) since
    the last reset of the accumulated statistics."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def add(self, delta: int) -> None:
        if delta >= 0:
            self.allocated += delta
        else:
            self.freed -= delta
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current

    def as_dict(self) -> dict[str, int]:
        return {
            "current": self.current,
            "peak": self.peak,
            "allocated": self.allocated,
            "freed": self.freed,
        }


class _Counters:
    """Process-wide counters of the fake device (all sizes in bytes)."""

    def __init__(self) -> None:
        # per pool (_ALL, _SMALL, _LARGE): live device bytes and live storages
        self.mem_bytes = [_Stat() for _ in _POOL_NAMES]
        self.mem_count = [_Stat() for _ in _POOL_NAMES]
        self.num_ooms = 0
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.transfers = 0
        self.device_ops = 0
        self.host_waits = 0
        self.synchronizes = 0
        self.stream_waits = 0
        self.events = 0
        self.races_detected = 0
        self.capacity: int | None = None
        # StorageImpl address (``UntypedStorage._cdata``, stable across ``resize_``) ->
        # [number of live inner tensors, storage nbytes, pool (_SMALL or _LARGE)]
        self.storages: dict[int, list[int]] = {}
        # data pointers of pinned host storages
        self.pinned: dict[int, int] = {}  # data pointer -> the pinned bytes CUDA would hold for it

    @property
    def allocated_bytes(self) -> int:
        """Bytes of live device storages."""
        return self.mem_bytes[_ALL].current

    @property
    def peak_bytes(self) -> int:
        """The maximum of ``allocated_bytes`` since the last peak reset."""
        return self.mem_bytes[_ALL].peak


_counters = _Counters()


def _out_of_memory(nbytes: int) -> torch.OutOfMemoryError:
    """The error of a failed allocation of ``nbytes`` bytes, counted in ``num_ooms``
    (lock held)."""
    _counters.num_ooms += 1
    return torch.OutOfMemoryError(
        f"fakegpu out of memory: tried to allocate {nbytes} bytes with "
        f"{_counters.allocated_bytes} bytes allocated and a capacity of "
        f"{_counters.capacity} bytes"
    )


def _check_capacity(nbytes: int) -> None:
    """Raise ``torch.OutOfMemoryError`` if ``nbytes`` more device bytes exceed the
    capacity (lock held)."""
    capacity = _counters.capacity
    if capacity is not None and nbytes > 0 and _counters.allocated_bytes + nbytes > capacity:
        raise _out_of_memory(nbytes)


def _pool_of(nbytes: int) -> int:
    return _SMALL if nbytes <= SMALL_POOL_MAX_BYTES else _LARGE


def _reserve(nbytes: int) -> int:
    """Count a new device storage of ``nbytes`` bytes and return its pool, or raise
    ``torch.OutOfMemoryError`` (lock held)."""
    _check_capacity(nbytes)
    pool = _pool_of(nbytes)
    for i in (_ALL, pool):
        _counters.mem_bytes[i].add(nbytes)
        _counters.mem_count[i].add(1)
    return pool


def _resize(entry: list[int], nbytes: int) -> None:
    """A live storage (its ``_counters.storages`` entry) now holds ``nbytes`` bytes: count
    the difference in its pool (the storage count is unchanged), or raise
    ``torch.OutOfMemoryError`` for a growth over the capacity (lock held)."""
    delta = nbytes - entry[1]
    _check_capacity(delta)
    for i in (_ALL, entry[2]):
        _counters.mem_bytes[i].add(delta)
    entry[1] = nbytes


def _release(entry: list[int]) -> None:
    """A device storage (its ``_counters.storages`` entry) was freed (lock held)."""
    for i in (_ALL, entry[2]):
        _counters.mem_bytes[i].add(-entry[1])
        _counters.mem_count[i].add(-1)


def _count_copy(direction: str, nbytes: int) -> None:
    with _lock:
        if direction == "h2d":
            _counters.h2d_bytes += nbytes
        else:
            _counters.d2h_bytes += nbytes
        _counters.transfers += 1


def _count_op(host_wait: bool) -> None:
    """Count one device op (a kernel launch or copy on a GPU); ``host_wait``: the host
    blocks on its result (a device->host read)."""
    with _lock:
        _counters.device_ops += 1
        if host_wait:
            _counters.host_waits += 1


def _count_host_wait() -> None:
    """Count one host wait that is no device op (a synchronize, a query, ``repr()``)."""
    with _lock:
        _counters.host_waits += 1


def stats() -> dict[str, int]:
    """Counters of the fake device.

    Returns:
        ``allocated_bytes`` (bytes of live device storages), ``peak_bytes`` (maximum of
        ``allocated_bytes`` since the last ``reset_stats``), ``h2d_bytes`` and ``d2h_bytes``
        (bytes copied host->device and device->host), ``transfers`` (tensor copies between
        host and device), ``device_ops`` and ``host_waits`` (below), ``synchronizes``
        (calls to the device-wide ``synchronize``),
        ``stream_waits`` (calls of ``Stream.wait_event``/``wait_stream``/``Event.wait``),
        ``events`` (``Event.record`` calls, ``Stream.record_event`` included),
        ``races_detected`` (races found, raised or pending), ``capacity`` (bytes, or -1
        for unlimited).

        ``device_ops``: ops on ``fakegpu`` tensors that a GPU would run as one kernel or
        copy each: every dispatch of an ATen op that is not a view (``OpOverload.is_view``
        false) and not metadata or allocation only, counted once per op the program
        issues (not the fake's own re-dispatches inside it). Not counted: views
        (``view``, ``t``, ``expand``, ``detach``, ``split``...), in-place view ops
        (tagged ``inplace_view``: ``t_``, ``detach_``, ``set_``, ``resize_``...),
        allocation without a fill (``empty``, ``empty_strided``, ``empty_like``,
        ``new_empty``, ``new_empty_strided``, ``empty_permuted``: no kernel on CUDA),
        ``_unsafe_view``, ``record_stream``, ``_fused_sdp_choice`` and shape/pinning
        queries, and ``t.data = new`` (rebinding, no copy). Counted: every compute
        kernel; fills (``zero_``, ``fill_``, ``zeros``, ``full``, ``ones_like``: one
        each); device factories that write (``arange``, ``linspace``); every copy
        (``copy_``, ``_to_copy``, ``clone``), host<->device copies included (these are
        ``transfers`` too), and ``.item()`` (one device->host copy).

        ``host_waits``: calls that block the host until device work completes, as on
        CUDA: every device->host copy (``.cpu()``, ``.to("cpu")``, ``.tolist()``,
        ``.item()``, ``copy_`` into a host tensor; a ``non_blocking`` one into pinned
        memory too, counted where it is issued although on CUDA it returns at once: the
        host must wait for it before it reads the result, and that later wait, an event
        or stream synchronize, counts as well), ops whose result the host
        reads inside them (tagged ``data_dependent_output``, such as ``equal``; ops whose
        output shape depends on the data, tagged ``dynamic_output_shape``, such as
        ``nonzero``, ``masked_select``, ``unique``, and ``index``/``index_put_`` with a
        boolean mask; ``_linalg_check_errors``, which reads the error codes back), the
        device-wide ``synchronize()``, ``Stream.synchronize()``, ``Event.synchronize()``,
        ``Stream.query()`` and ``Event.query()`` (every call, whatever it returns), and
        ``repr()`` of a ``fakegpu`` tensor. Host->device copies are never host waits
        (on CUDA a blocking copy from pageable memory also synchronizes the stream;
        not modelled). The ops among these are device ops too.
    """
    with _lock:
        return {
            "allocated_bytes": _counters.allocated_bytes,
            "peak_bytes": _counters.peak_bytes,
            "h2d_bytes": _counters.h2d_bytes,
            "d2h_bytes": _counters.d2h_bytes,
            "transfers": _counters.transfers,
            "device_ops": _counters.device_ops,
            "host_waits": _counters.host_waits,
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


def reset_stats() -> None:
    """Zero the transfer, device-op, host-wait, synchronize, stream-wait, event and race
    counters;
    ``peak_bytes`` := ``allocated_bytes``.

    the accumulated memory statistics of ``memory_stats()`` (its ``allocated``/``freed``
    totals and ``num_ooms``) are zeroed and its peaks set to the current values too.

    Races found at frees and not yet raised are dropped too (the ``fake_device`` test
    fixture calls this first, so a race left by an earlier test does not fail the next).
    Stream ordering state (what each stream has waited on, the copies still pending for
    the host) is kept.
    """
    with _lock:
        _reset_peaks()
        _reset_accumulated()
        _counters.h2d_bytes = 0
        _counters.d2h_bytes = 0
        _counters.transfers = 0
        _counters.device_ops = 0
        _counters.host_waits = 0
        _counters.synchronizes = 0
        _counters.stream_waits = 0
        _counters.events = 0
        _counters.races_detected = 0
        state.deferred.clear()


def _reset_peaks() -> None:
    for stat in (*_counters.mem_bytes, *_counters.mem_count):
        stat.peak = stat.current


def _reset_accumulated() -> None:
    for stat in (*_counters.mem_bytes, *_counters.mem_count):
        stat.allocated = stat.freed = 0
    _counters.num_ooms = 0


def reset_peak() -> None:
    """Make ``peak_bytes`` equal to ``allocated_bytes`` (and every peak of
    ``memory_stats()`` its current value); other counters are kept."""
    with _lock:
        _reset_peaks()


def reset_accumulated_memory_stats() -> None:
    """Zero the accumulated statistics of ``memory_stats()``: the ``allocated`` and
    ``freed`` totals of every statistic, and ``num_ooms``. Current values and peaks are
    kept (as ``torch.cuda.reset_accumulated_memory_stats``)."""
    with _lock:
        _reset_accumulated()


def memory_stats_nested() -> dict[str, object]:
    """The fake device's allocator statistics, nested as CUDA's
    ``torch._C._accelerator_getDeviceStats`` returns them (``torch.accelerator
    .memory_stats()`` flattens this into ``"allocated_bytes.all.current"``-style keys).

    Byte statistics (``allocated_bytes``, ``reserved_bytes``, ``active_bytes``,
    ``requested_bytes``) and storage counts (``allocation``, ``segment``, ``active``) per
    pool (``all``, ``small_pool``: storages of at most ``SMALL_POOL_MAX_BYTES`` = 1 MiB when
    allocated, ``large_pool``: larger ones), each with ``current``, ``peak``,
    ``allocated`` and ``freed``. The fake has no caching allocator: every storage is its
    own segment, freed memory is returned at once and sizes are not rounded, so the
    reserved, active and requested statistics equal the allocated ones (bytes exact: on
    CUDA, ``allocated_bytes`` rounds each block up to 512 B) and ``inactive_split``,
    ``inactive_split_bytes``, ``oversize_allocations`` and ``oversize_segments`` are 0.
    ``allocated_bytes.all.current`` is ``stats()["allocated_bytes"]`` and
    ``allocated_bytes.all.peak`` is ``stats()["peak_bytes"]``. A storage grown or shrunk in
    place (``resize_``) stays one allocation; its size change is counted in its pool's
    bytes (``allocated`` for a growth, ``freed`` for a shrink). ``num_ooms`` counts the
    allocations refused for the capacity; ``num_device_alloc`` and ``num_device_free`` the
    storages allocated and freed (since the last accumulated reset);
    ``num_alloc_retries`` and ``num_sync_all_streams`` are 0; ``max_split_size`` is -1
    (unlimited, CUDA's default).
    """
    with _lock:
        by_bytes = {p: _counters.mem_bytes[i].as_dict() for i, p in enumerate(_POOL_NAMES)}
        by_count = {p: _counters.mem_count[i].as_dict() for i, p in enumerate(_POOL_NAMES)}
        allocs = _counters.mem_count[_ALL]
        zero = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}

        def copy(stats: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
            return {p: dict(v) for p, v in stats.items()}

        return {
            "num_alloc_retries": 0,
            "num_ooms": _counters.num_ooms,
            "max_split_size": -1,
            "num_sync_all_streams": 0,
            "num_device_alloc": allocs.allocated,
            "num_device_free": allocs.freed,
            "allocated_bytes": copy(by_bytes),
            "reserved_bytes": copy(by_bytes),
            "active_bytes": copy(by_bytes),
            "requested_bytes": copy(by_bytes),
            "allocation": copy(by_count),
            "segment": copy(by_count),
            "active": copy(by_count),
            "inactive_split": {p: dict(zero) for p in _POOL_NAMES},
            "inactive_split_bytes": {p: dict(zero) for p in _POOL_NAMES},
            "oversize_allocations": dict(zero),
            "oversize_segments": dict(zero),
        }


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
