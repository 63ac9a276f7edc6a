"""The staging ring: the pinned host buffers through which disk-backed bytes reach the device.

A disk-backed host copy is a private memory map of a safetensors file (``tiers``): its
pages are not pinned, so an H2D copy straight from it would be synchronous (and, under
CUDA, go through the driver's own bounce buffer). The ring holds ``STAGING_COUNT``
pinned buffers of ``chunk`` bytes; a load reads the bytes of one chunk of the
destination into a buffer, then queues one asynchronous H2D copy of the whole buffer,
while the other buffer is being filled. A buffer is filled again only once its copy's
event completed: that event wait is the only host wait, one per buffer reuse.

The destination is one device allocation for many host copies (an arena, ``arena``):
the ring packs the sources at their offsets, fills the alignment padding between them
with zeros, and copies chunk by chunk, so a load of ``n`` bytes is ``ceil(n / chunk)``
H2D copies whatever the number of tensors (issue 34: one copy per staging chunk).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import hostmem
from .platform import Platform

__all__ = ["STAGING_CHUNK", "STAGING_COUNT", "Fill", "Span", "StagingRing"]

STAGING_CHUNK = 64 << 20
"""Largest staging-ring buffer, in bytes (64 MiB); a ring holds ``STAGING_COUNT`` of them."""

STAGING_COUNT = 2
"""Buffers in a staging ring: one filled from disk while the other's copy runs."""

Fill = Callable[[torch.Tensor, int], None]
"""``fill(view, start)``: write bytes ``start .. start + view.numel()`` of a source into
``view`` (a pinned host ``uint8`` buffer), e.g. ``os.preadv`` from its file."""

Span = tuple[int, int, Any, "Fill | None", "torch.Tensor | None"]
"""``(offset, nbytes, key, fill, source)``: ``nbytes`` placed at byte ``offset`` of the
destination; ``key`` is handed to the ``begin``/``end`` callbacks; ``fill`` reads the bytes
into the ring, else they are copied from ``source`` (a host ``uint8`` tensor, e.g. a
memory map; a ring without pinned buffers always copies from it)."""


class StagingRing:
    """``STAGING_COUNT`` pinned host buffers of ``chunk`` bytes each (made at the first
    copy, dropped by ``release``).

    Args:
        platform: the device's platform (events, synchronize).
        nbytes: the ring's total size in bytes (``STAGING_COUNT`` equal buffers).
        pin: pin the buffers. Without it the ring holds no memory: each source is copied
            to the device by itself, synchronously (and the padding zeroed on the device).
        charge: called with the pinned bytes of each buffer made, and with their negation
            once it is freed (``hostmem.host_buffer``; ``TransferStats.charge_pinned``).

    Attributes:
        chunk: bytes per buffer (at least 1).
        nbytes: host bytes the ring holds once made (0 without ``pin``).
        charged: pinned bytes of the buffers alive now (in ``charge``'s gauge).
        reuses: times a buffer was filled again after a copy from it (each one event
            wait of the host, ``Event.synchronize``).
    """

    def __init__(
        self, platform: Platform, nbytes: int, pin: bool, charge: Callable[[int], None] = lambda n: None
    ) -> None:
        self.platform = platform
        self._charge_outer = charge
        self.charged = 0  # pinned bytes of the buffers alive now
        self.chunk = max(nbytes // STAGING_COUNT, 1)
        self.pin = pin
        self.nbytes = STAGING_COUNT * self.chunk if pin else 0
        self.reuses = 0
        self._bufs: list[torch.Tensor] = []
        self._events: list[Any] = [None] * STAGING_COUNT
        self._next = 0

    def _charge(self, nbytes: int) -> None:
        self.charged += nbytes
        self._charge_outer(nbytes)

    @property
    def reserved(self) -> int:
        """Bytes of the ring not made yet (``nbytes`` less the buffers alive): what it will
        still take from the host budget."""
        return max(self.nbytes - self.charged, 0)

    def release(self) -> None:
        """Drop the buffers (after their copies completed); a later copy makes them again."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._bufs = []
        self._events = [None] * STAGING_COUNT
        self._next = 0

    def _buffer(self) -> torch.Tensor:
        """The next buffer, once the copy last queued from it completed."""
        i = self._next
        self._next = (i + 1) % STAGING_COUNT
        event = self._events[i]
        if event is not None:
            event.synchronize()  # the one host wait: this buffer's previous copy
            self._events[i] = None
            self.reuses += 1
        while len(self._bufs) <= i:
            self._bufs.append(hostmem.host_buffer(self.chunk, torch.uint8, self.platform, True, self._charge))
        return self._bufs[i]

    def _queued(self) -> None:
        """Record the event of the copy just queued from the buffer last handed out."""
        event = self.platform.new_event()
        if event is None:  # no events on this platform: the copy is done once synchronized
            self.platform.synchronize()
        else:
            event.record()
        self._events[(self._next - 1) % STAGING_COUNT] = event

    def copy(
        self,
        spans: Sequence[Span],
        dst: torch.Tensor,
        read: Callable[[int, float], None],
        begin: Callable[[Any], None] | None = None,
        end: Callable[[Any], None] | None = None,
    ) -> int:
        """Copy the sources of ``spans`` (in offset order, not overlapping, within ``dst``)
        into ``dst`` (a device ``uint8`` tensor) at their offsets, every byte of ``dst``
        outside them set to zero, on the current stream.

        ``read(nbytes, seconds)`` is called for each piece read from a source (the disk
        tier's counters: its bytes and the seconds its read took; each piece is read by
        its span's ``fill`` when it has one), ``begin(key)`` before the first byte of a
        span is read and ``end(key)`` after its last one (the reader thread's hooks).

        Returns:
            The H2D copies queued: ``ceil(dst.numel() / chunk)`` with a pinned ring, one
            per source without (plus one zeroing per gap of padding).
        """
        total = dst.numel()
        if not self.pin:
            return self._copy_pageable(spans, dst, read, begin, end)
        copies = 0
        k = 0  # the first span not wholly staged yet
        for lo in range(0, total, self.chunk):
            hi = min(lo + self.chunk, total)
            buf = self._buffer()[: hi - lo]
            pos = lo
            while k < len(spans) and spans[k][0] < hi:
                offset, n, key, fill, src = spans[k]
                a, b = max(offset, lo), min(offset + n, hi)
                if a > pos:
                    buf[pos - lo : a - lo].zero_()
                if a == offset and begin is not None:
                    begin(key)
                t0 = time.perf_counter()
                if fill is None:
                    assert src is not None
                    buf[a - lo : b - lo].copy_(src[a - offset : b - offset])
                else:
                    fill(buf[a - lo : b - lo], a - offset)
                read(b - a, time.perf_counter() - t0)
                pos = b
                if b < offset + n:
                    break  # continues in the next chunk
                if end is not None:
                    end(key)
                k += 1
            if pos < hi:
                buf[pos - lo :].zero_()
            dst[lo:hi].copy_(buf, non_blocking=True)
            self._queued()
            copies += 1
        return copies

    def _copy_pageable(
        self,
        spans: Sequence[Span],
        dst: torch.Tensor,
        read: Callable[[int, float], None],
        begin: Callable[[Any], None] | None,
        end: Callable[[Any], None] | None,
    ) -> int:
        copies = 0
        pos = 0
        for offset, _, key, _, src in spans:  # no pinned buffer to read into: from the map
            assert src is not None
            if offset > pos:
                dst[pos:offset].zero_()
            if begin is not None:
                begin(key)
            t0 = time.perf_counter()
            dst[offset : offset + src.numel()].copy_(src)  # the read and the copy, together
            read(src.numel(), time.perf_counter() - t0)
            copies += 1
            if end is not None:
                end(key)
            pos = offset + src.numel()
        if pos < dst.numel():
            dst[pos:].zero_()
        return copies
