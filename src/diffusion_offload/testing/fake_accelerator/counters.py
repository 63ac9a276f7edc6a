"""Accounting of the fake device: its counters, ``stats()`` and their resets, the live
device storages and the capacity that allocations are checked against.
"""

from __future__ import annotations

import torch

from .state import _lock, state


class _Counters:
    """Process-wide counters of the fake device (all sizes in bytes)."""

    def __init__(self) -> None:
        self.allocated_bytes = 0
        self.peak_bytes = 0
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
        # [number of live inner tensors, storage nbytes]
        self.storages: dict[int, list[int]] = {}
        # data pointers of pinned host storages
        self.pinned: set[int] = set()


_counters = _Counters()


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
        _counters.device_ops = 0
        _counters.host_waits = 0
        _counters.synchronizes = 0
        _counters.stream_waits = 0
        _counters.events = 0
        _counters.races_detected = 0
        state.deferred.clear()


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
