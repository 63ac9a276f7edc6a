"""The disk tier: the host copies a host budget leaves on disk, and how they reach the device.

A ``DiskTier`` (one per enabled backend whose tier plan, ``tiers.plan_tiers``, leaves
weights on disk) knows which slots are disk-backed, reads their bytes from their files
into the pinned ``staging.StagingRing`` (``os.preadv``, in runs of back-to-back tensors),
advises the kernel ahead of and after each read (``posix_fadvise``), records the write
checks' fingerprints of slots loaded by themselves, and counts the copy-on-write pages of
written weights against the budget.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from . import checksum, hostmem
from .platform import Platform, same_device
from .readahead import ReadAhead
from .staging import StagingRing
from .tiers import FP_BLOCK, FileMaps, HostBudgetError, TierPlan, mark_written
from .writes import fingerprints

__all__ = ["DiskTier"]


def _close_all(fds: dict[str, int]) -> None:
    """Close the descriptors of ``fds`` (path -> descriptor) and forget them."""
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class DiskTier:
    """The disk-backed host copies of one enabled backend: which slots they are, how they
    reach the device (``StagingRing``), and their counters in the mover's ``stats``
    (``disk_backed_bytes``, ``disk_read_bytes``, ``cow_bytes``, ``staging_bytes``).

    ``transfer.Mover`` calls it through ``Mover.disk``: ``wants`` (keep this tensor off
    arenas and unpinned), ``claim`` (these slots are disk-backed), ``holds``, ``to_device``
    (a load), ``note_write`` (a write-back into a private copy-on-write page).

    Args:
        plan: the tier plan (``plan_tiers``).
        platform: the device's platform.
        stats: the mover's ``TransferStats``.
        pin: pin the staging ring.
        read_ahead: run a ``ReadAhead`` reader thread.

    Attributes:
        read_delay: seconds slept per byte read from a disk-backed host copy the reader
            has not read ahead: a test knob that simulates a slow disk (0: none). The
            reader sleeps it when it reads ahead; a load of a slot read ahead does not.
        reader: the ``ReadAhead`` thread, or None.
    """

    def __init__(
        self,
        plan: TierPlan,
        platform: Platform,
        stats: Any,
        pin: bool,
        read_ahead: bool = True,
        maps: FileMaps | None = None,
        drop_pages: bool = False,
    ) -> None:
        self.maps = maps
        self.drop_pages = drop_pages
        self._files: dict[int, tuple[str, int]] = {}  # id(slot) -> (path, byte offset)
        self._fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)  # a tier dropped without close()
        self.plan = plan
        self.platform = platform
        self.stats = stats
        self.ring = StagingRing(platform, plan.staging_bytes, pin, stats.charge_pinned)
        self.read_delay = 0.0
        self._slots: dict[int, tuple[Any, int]] = {}  # id(slot) -> (slot, host data_ptr)
        # fingerprints recorded at loads (``record``): id(slot) -> its entries (a view of a
        # host int64 block of FP_BLOCK entries, pinned with the ring; a slot with more
        # members gets a buffer of its own), the free entries of the last block, and the
        # slots recorded since their last load
        self._fp_views: dict[int, torch.Tensor] = {}
        self._fp_block: torch.Tensor | None = None
        self._fp_free = 0
        self._loaded: set[int] = set()
        self._written: set[int] = set()
        self._cow_bytes = 0  # this tier's share of ``stats.cow_bytes``
        self._closed = False
        stats.staging_bytes = self.ring.nbytes
        self.reader: ReadAhead | None = ReadAhead(self, plan.staging_bytes) if read_ahead else None

    def wants(self, objs: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``objs`` stays on disk (its host copy must stay the file map)."""
        return any(id(o) in self.plan.disk_ids for o in objs)

    def claim(self, slot: Any) -> bool:
        """Register ``slot`` as disk-backed if its members stay on disk; True if so."""
        if slot.host is None or not self.wants(m.obj for m in slot.members):
            return False
        self._slots[id(slot)] = (slot, slot.host.data_ptr())
        back = self.maps.backing(slot.host) if self.maps is not None else None
        if back is not None:
            path, start = back
            within = slot.host.data_ptr() - slot.host.untyped_storage().data_ptr()
            self._files[id(slot)] = (path, start + within)
            # read from the file from now on: the pages loading mapped leave the process
            # (RssFile), so the kernel can drop them from the page cache
            hostmem.page_out(slot.host)
        return True

    def file_position(self, slot: Any) -> tuple[str, int]:
        """``(file path, byte offset)`` of the disk-backed ``slot``'s bytes (``("", 0)``
        when unknown): disk arenas lay their slots out in this order, so a load reads
        runs of back-to-back tensors (safetensors orders a file's tensors by dtype and
        name, not by module order)."""
        return self._files.get(id(slot), ("", 0))

    def file_ranges(self) -> list[tuple[str, int, int]]:
        """``(file path, byte offset, bytes)`` of every disk-backed slot read from its
        file (``_readable``), in the order they were claimed (a bench's plain read, a
        test's page-cache probe)."""
        return [(*w, slot.nbytes) for slot, _ in self._slots.values() if (w := self._readable(slot))]

    def _fd(self, path: str) -> int:
        """A read-only descriptor of ``path``, opened once, advised sequential."""
        with self._fd_lock:  # the reader thread opens files too
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return fd

    def _fill(self, slot: Any) -> Any:
        """How the ring reads ``slot``'s bytes: ``os.preadv`` from its file straight into
        the pinned staging buffer (no pass through the memory map's page faults), or None
        (copied from the map) when it has no file (written: its pages are private now) or
        the platform has no ``preadv``. Buffered reads, not ``O_DIRECT``: safetensors
        places tensors at 8-byte, not 4096-byte, aligned offsets, which ``O_DIRECT``
        refuses (open(2)), and warm requests read from the page cache."""
        where = self._readable(slot)
        return None if where is None else self._file_fill(*where)

    def _readable(self, slot: Any) -> tuple[str, int] | None:
        """``slot``'s ``(path, byte offset)`` when its bytes are read from its file: it
        has one, was not written (its pages are private then) and ``os.preadv`` and
        ``os.posix_fadvise`` exist here; else None."""
        where = self._files.get(id(slot))
        if where is None or id(slot) in self._written or not hasattr(os, "preadv"):
            return None
        return where if hasattr(os, "posix_fadvise") else None

    def _file_fill(self, path: str, base: int) -> Any:
        """A ring ``Fill`` reading bytes of ``path`` from byte ``base`` on (``os.preadv``)."""
        fd = self._fd(path)

        def fill(view: torch.Tensor, start: int) -> None:
            mv = memoryview(view.numpy()).cast("B")
            done = 0
            while done < len(mv):
                n = os.preadv(fd, [mv[done:]], base + start + done)
                if n <= 0:
                    raise OSError(f"{path}: short read at byte {base + start + done}")
                done += n

        return fill

    def holds(self, slot: Any) -> bool:
        """Whether ``slot``'s host copy is (still) its disk-backed file map."""
        entry = self._slots.get(id(slot))
        return entry is not None and entry[0] is slot and slot.host is not None and (
            slot.host.data_ptr() == entry[1]
        )

    def read_file(self, slot: Any) -> bool:
        """The reader thread's read ahead of ``slot``: ``posix_fadvise(WILLNEED)`` on its
        file bytes, so the kernel reads them into the page cache in the background (no
        copy, no page mapped into the process: the kernel may still drop them); the load's
        ``os.preadv`` then copies from the page cache. False when ``slot`` has no file to
        advise (written, or no ``posix_fadvise``/``preadv`` here)."""
        where = self._readable(slot)
        if where is None:
            return False
        os.posix_fadvise(self._fd(where[0]), where[1], slot.nbytes, os.POSIX_FADV_WILLNEED)
        return True

    def _read(self, nbytes: int, seconds: float) -> None:
        self.stats.disk_read_bytes += nbytes
        self.stats.disk_read_seconds += seconds

    def _begin(self, slots: tuple[Any, ...]) -> None:
        """Before the first byte of ``slots`` (one span) is read: wait for the reader if
        it is reading one, or sleep the ``read_delay`` knob for those nobody read ahead."""
        reader = self.reader
        for slot in slots:
            self._loaded.discard(id(slot))
            if reader is not None:
                reader.take(slot)
            elif self.read_delay:
                time.sleep(self.read_delay * slot.nbytes)

    def _end(self, slots: tuple[Any, ...]) -> None:
        """After the last byte of ``slots`` (one span) is read into the ring: with
        ``drop_pages`` their file pages leave the page cache; the reader reads what
        followed them."""
        if self.drop_pages:
            self._advise(slots, os.POSIX_FADV_DONTNEED)
        if self.reader is not None:
            for slot in slots:
                self.reader.after(slot)

    def _advise(self, slots: tuple[Any, ...], advice: int) -> None:
        """``posix_fadvise(advice)`` over the file range of ``slots`` (one span: back to
        back in one file, ``_spans``), one call; nothing for a span not read from a file."""
        where = self._readable(slots[0])
        if where is not None:
            os.posix_fadvise(self._fd(where[0]), where[1], sum(s.nbytes for s in slots), advice)

    def _stage(self, spans: list[Any], dst: torch.Tensor) -> None:
        """Copy ``spans`` (``_spans``) into ``dst`` through the ring, counted in ``stats``:
        the kernel is first advised to read every span's file range (``WILLNEED``: its
        reads start before the copy reaches them); with ``drop_pages`` the ranges are
        advised ``DONTNEED`` once more after the copy (the kernel skips pages still in
        another CPU's LRU batch the first time)."""
        for span in spans:
            self._advise(span[2], os.POSIX_FADV_WILLNEED)
        reuses = self.ring.reuses
        self.stats.staging_copies += self.ring.copy(spans, dst, self._read, self._begin, self._end)
        self.stats.staging_waits += self.ring.reuses - reuses
        for span in spans if self.drop_pages else ():
            self._advise(span[2], os.POSIX_FADV_DONTNEED)

    def _spans(self, placed: list[tuple[int, Any]]) -> list[Any]:
        """The ring's spans (``staging.Span``) for ``(offset, slot)`` pairs in offset
        order: with a pinned ring, slots back to back both in the destination and in one
        file are one span (one ``os.preadv`` per staging chunk of the run instead of one
        per tensor: a safetensors file stores a model's tensors back to back)."""
        runs: list[tuple[int, int, tuple[Any, ...], tuple[str, int] | None]] = []
        for offset, slot in placed:
            where = self._readable(slot)
            if runs and self.ring.pin and where is not None:
                start, n, keys, first = runs[-1]
                if first is not None and start + n == offset and (first[0], first[1] + n) == where:
                    runs[-1] = (start, n + slot.nbytes, (*keys, slot), first)
                    continue
            runs.append((offset, slot.nbytes, (slot,), where))
        return [
            (start, n, keys, None if first is None else self._file_fill(*first),
             keys[0].host if len(keys) == 1 else None)
            for start, n, keys, first in runs
        ]

    def to_device(self, slot: Any, device: torch.device) -> torch.Tensor:
        """A device copy of the disk-backed ``slot``'s host span (``uint8``), through the
        ring (a slot loaded by itself: its arena is not loaded whole)."""
        dst = torch.empty(slot.nbytes, dtype=torch.uint8, device=device)
        self._stage(self._spans([(0, slot)]), dst)
        return dst

    def arena_to_device(self, arena: Any, device: torch.device) -> torch.Tensor:
        """One device allocation of ``arena.nbytes`` (``uint8``) holding the host copies of
        the disk arena's slots at their offsets, padding zeroed (``arena.Arena`` without a
        host buffer): one H2D copy per staging chunk, on the current stream."""
        dst = torch.empty(arena.nbytes, dtype=torch.uint8, device=device)
        self._stage(self._spans([(arena.offsets[id(s)], s) for s in arena.slots]), dst)
        return dst

    def record(self, slot: Any) -> None:
        """After a load of the disk-backed ``slot`` (``to_device``), on the current stream:
        the fingerprints of its members' device bytes (``writes.fingerprints``), copied to
        the host without a host wait. The write check at eviction compares with them
        (``recorded``) instead of reading the host copy from disk again. Nothing for a slot
        that is not disk-backed, not on the device, or recorded since its load.

        Raises:
            torch.OutOfMemoryError: no device room for the fingerprints' temporaries
                (about ``48 * sqrt(n)`` bytes a tensor of ``n`` bytes).
        """
        if id(slot) in self._loaded or not self.holds(slot):
            return
        members = slot.members
        if not same_device(members[0].payload.device, self.platform.device):
            return
        with torch.inference_mode(False), torch.no_grad():
            device = fingerprints([m.payload for m in members])
            self._fp_view(slot).copy_(device, non_blocking=self.ring.pin)
        self._loaded.add(id(slot))
        s = self.stats
        s.fingerprints += len(members)
        s.fingerprint_bytes += sum(m.nbytes for m in members)
        s.check_d2h_bytes += 8 * len(members)
        s.check_h2d_bytes += checksum.weights_bytes(m.nbytes for m in members)
        checksum.count_pinned(s)

    def _fp_view(self, slot: Any) -> torch.Tensor:
        """``slot``'s entries for its fingerprints, one per member (host ``int64``), made at
        its first use: a view of the last fingerprint block while it has room, else of a
        new one; a slot with more members than a block holds gets a buffer of its own."""
        view = self._fp_views.get(id(slot))
        if view is None:
            n = len(slot.members)
            if n > FP_BLOCK:
                view = self._host_int64(n)
            else:
                if n > self._fp_free:
                    self._fp_block, self._fp_free = self._host_int64(FP_BLOCK), FP_BLOCK
                start = FP_BLOCK - self._fp_free
                view = self._fp_block[start : start + n]  # type: ignore[index]
                self._fp_free -= n
            self._fp_views[id(slot)] = view
        return view

    def _host_int64(self, n: int) -> torch.Tensor:
        return hostmem.host_buffer(n, torch.int64, self.platform, self.ring.pin, self.stats.charge_pinned)

    def recorded(self, slot: Any) -> torch.Tensor | None:
        """The fingerprints ``record`` took at ``slot``'s last load (host ``int64``, one per
        member, in order), or None: not disk-backed, not on the device, or not recorded.
        Their copy was queued on the load's stream: read them after a host wait that
        follows it (the check's own device fingerprints read back, ``checks``)."""
        if id(slot) not in self._loaded or not self.holds(slot):
            return None
        if not slot.on_device(self.platform.device):
            return None
        return self._fp_view(slot)

    def close(self) -> None:
        """At ``disable``: stop the reader thread, free the staging ring and the
        fingerprint buffers, and take this tier's gauges out of ``stats``
        (``staging_bytes``, and the ``cow_bytes`` it counted), so a later ``enable``
        starts from what it plans itself. Idempotent."""
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        with self._fd_lock:
            _close_all(self._fds)
        if self._closed:
            return
        self._closed = True
        self.ring.release()
        self.stats.staging_bytes -= self.ring.nbytes
        self.stats.cow_bytes -= self._cow_bytes
        self._cow_bytes = 0
        self._fp_views.clear()
        self._fp_block, self._fp_free = None, 0
        self._loaded.clear()
        self._written.clear()

    def note_write(self, slot: Any) -> None:
        """``slot``'s host copy is about to be written (a write-back, a host replacement):
        its private copy-on-write pages become anonymous memory, counted in ``cow_bytes``
        until ``close`` (``disable``); a later plan counts that weight in RAM (``FileMaps``).

        Raises:
            HostBudgetError: those pages do not fit the budget with what is in RAM now
                (host copies, ring, written pages); nothing was written, the new values
                stay where they are.
        """
        if id(slot) in self._written:
            return
        s = self.stats
        ram_in_use = s.pinned_total_bytes + s.pageable_host_bytes + s.cow_bytes + self.ring.reserved
        budget = self.plan.budget
        if ram_in_use + slot.nbytes > budget:
            raise HostBudgetError(
                f"host_memory_budget={budget} bytes has no room for the {slot.nbytes} bytes of "
                f"a written disk-backed weight ({ram_in_use} bytes in RAM already): its "
                "private copy-on-write copy would exceed the budget; the new values stay on "
                "the device. Raise the budget, or disable() and enable() again after writing "
                "weights"
            )
        self._written.add(id(slot))
        self._cow_bytes += slot.nbytes
        self.stats.cow_bytes += slot.nbytes
        mark_written(slot.host)
