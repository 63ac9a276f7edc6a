"""The disk tier's reader thread: disk-backed host copies read ahead of their loads.

The ``DiskTier`` (``tiers.py``) owns one ``ReadAhead`` when ``read_ahead`` is on; this
module knows the tier only through a weak reference and the slots it is handed (objects
with ``host``, a host tensor, and ``nbytes``).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

__all__ = ["ReadAhead"]


class ReadAhead:
    """A reader thread that reads disk-backed host copies ahead of their loads, so disk
    time overlaps compute.

    It learns the order of loads (which slot was loaded after which, last time: the next
    blocks in layer mode, the next component's slots in module mode) and, after each
    load, reads the slots that followed it, at most ``limit`` bytes ahead (the staging
    ring's size): their pages come into the page cache (``DiskTier.read_file``: the kernel
    is advised to read them, ``POSIX_FADV_WILLNEED``, so no page is mapped into the
    process and the kernel may still drop them; a slot without a file: one byte a page of
    its map is read), and the ``DiskTier.read_delay`` knob is slept
    there instead of in the load. A load of a slot being read waits for it.

    The thread holds only a weak reference to its ``ReadAhead`` while it waits (and to
    the tier it reads for, always): a pipeline and backend dropped without ``disable()``
    are collected, weights and device memory included, and the thread then exits by
    itself (a ``weakref.finalize`` of the reader wakes it). While it reads one slot it
    holds that slot and the reader; the owner is collected once that read finishes.

    Args:
        tier: the ``disktier.DiskTier`` it reads for (its ``read_delay`` is read; not
            imported here: ``tiers`` imports this module).
        limit: bytes read ahead of the slot last loaded, at most.
    """

    def __init__(self, tier: Any, limit: int) -> None:
        self._tier = weakref.ref(tier)  # the tier holds the reader: no cycle to collect
        self.limit = max(limit, 1)
        self._next: dict[int, Any] = {}  # id(slot) -> the slot loaded after it last time
        self._last: Any = None
        self._queue: list[Any] = []
        self._busy: Any = None
        self._ready: set[int] = set()  # read ahead, not loaded since
        # reentrant: the finalizer that wakes the thread may run inside a collection the
        # thread itself triggers while it holds the lock
        self._cond = threading.Condition(threading.RLock())
        self._stop = False
        self._thread = threading.Thread(
            target=ReadAhead._run, args=(weakref.ref(self), self._cond),
            name="diffusion-offload-reader", daemon=True,
        )
        weakref.finalize(self, ReadAhead._wake, self._cond)
        self._thread.start()

    @property
    def tier(self) -> Any:
        """The disk tier this reader reads for (None once it was collected)."""
        return self._tier()

    def take(self, slot: Any) -> None:
        """Before ``slot``'s load: wait if it is being read; sleep the knob if it was not
        read ahead. Learns that ``slot`` followed the previous load."""
        key = id(slot)
        with self._cond:
            if self._last is not None and self._last is not slot:
                self._next[id(self._last)] = slot
            self._last = slot
            if any(s is slot for s in self._queue):
                self._queue = [s for s in self._queue if s is not slot]
            while self._busy is slot:
                self._cond.wait()
            warm = key in self._ready
            self._ready.discard(key)
        delay = self._delay()
        if not warm and delay:
            time.sleep(delay * slot.nbytes)

    def after(self, slot: Any) -> None:
        """After ``slot``'s load: queue what followed it last time, up to ``limit`` bytes."""
        ahead: list[Any] = []
        total = 0
        seen = {id(slot)}
        nxt = self._next.get(id(slot))
        while nxt is not None and id(nxt) not in seen and total + nxt.nbytes <= self.limit:
            seen.add(id(nxt))
            ahead.append(nxt)
            total += nxt.nbytes
            nxt = self._next.get(id(nxt))
        with self._cond:
            self._queue = [
                s for s in ahead if id(s) not in self._ready and s is not self._busy
            ]
            self._cond.notify_all()

    def _delay(self) -> float:
        tier = self._tier()
        return tier.read_delay if tier is not None else 0.0

    @staticmethod
    def _wake(cond: threading.Condition) -> None:
        """The finalizer of a collected reader: wake its thread, which then exits."""
        with cond:
            cond.notify_all()

    @staticmethod
    def _run(ref: "weakref.ReferenceType[ReadAhead]", cond: threading.Condition) -> None:
        """The thread: a strong reference to the reader only while it takes or reads a
        slot, none while it waits; returns once the reader is closed or collected."""
        while True:
            with cond:
                while True:
                    reader = ref()
                    if reader is None or reader._stop:
                        return
                    if reader._queue:
                        break
                    del reader
                    cond.wait()
                slot = reader._busy = reader._queue.pop(0)
            tier = reader.tier
            if tier is None or not tier.read_file(slot):
                host = slot.host
                if host is not None and host.numel():
                    host[::4096].sum()  # one byte a page: the kernel reads every page
                del host
            del tier
            delay = reader._delay()
            if delay:
                time.sleep(delay * slot.nbytes)
            with cond:
                reader._ready.add(id(slot))
                reader._busy = None
                cond.notify_all()
            del reader, slot  # the owner may be collected while the thread waits

    def close(self) -> None:
        """Stop the thread (it finishes the slot it is reading) and wait for it to exit."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()
