"""The host-memory budget and its tiers: pinned, pageable, disk (issue 20).

A ``host_memory_budget`` bounds the host memory the offload engine's host copies take:
the pinned and pageable host copies (arenas and copies of their own), the pinned staging
ring, and the private copy-on-write pages of written disk-backed weights. Within it:

* **pinned**: host copies in page-locked memory, up to ``max_pinned_bytes``;
* **pageable**: the rest of the host copies that fit the budget;
* **disk**: weights that do not fit stay file-backed: the loaded tensors are private
  (copy-on-write) memory maps of their safetensors files (diffusers and safetensors
  load them that way, ``torch.UntypedStorage.from_file(path, shared=False)``), so their
  bytes live in the page cache, which the kernel reclaims, not in anonymous memory.
  Each load copies them to the device through a bounded pinned ``staging.StagingRing``
  (``disktier.DiskTier``).

The choice (``plan_tiers``) is made once, at ``enable``: never disk when RAM suffices.
Weights that are not file-backed (cast at load, fused with a LoRA, quantized, read from
GGUF, built in memory) can only live in RAM; when they alone (with the staging ring)
exceed the budget, ``enable`` fails with ``HostBudgetError``. A disk-backed weight written
under one ``enable`` (``DiskTier.note_write``: its written pages are anonymous memory) is
one of those at the next ``enable``; so are the copies a plan put in RAM (arenas), once
``disable`` gave them back to the pipeline.

``"auto"`` (``auto_host_budget``) is ``min(MemAvailable, cgroup limit - cgroup usage)``
(cgroup v2 and v1; usage without inactive file pages, which the kernel reclaims) plus the
host copies already held, minus ``reserve_bytes``: a tenth of that, at most ``AUTO_RESERVE``
(2 GiB). Sources: ``/proc/meminfo`` (proc(5)); the kernel's cgroup v2 ``memory.max``,
``memory.current``, ``memory.stat`` and cgroup v1 ``memory.limit_in_bytes``,
``memory.usage_in_bytes``, ``memory.stat`` (Documentation/admin-guide/cgroup-v2.rst,
cgroup-v1/memory.rst); ``/proc/self/maps`` for which tensors are file-backed.
"""

from __future__ import annotations

import bisect
import os
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checksum, hostmem
from .arena import ALIGN, ARENA_BYTES
from .staging import STAGING_CHUNK, STAGING_COUNT

__all__ = [
    "AUTO_RESERVE",
    "FileMaps",
    "HostBudgetError",
    "TierPlan",
    "auto_host_budget",
    "cgroup_limited",
    "check_budget",
    "file_backed",
    "host_room",
    "mark_written",
    "plan_tiers",
    "reserve_bytes",
    "split_tiers",
    "stage_unit",
]

AUTO_RESERVE = 2 << 30
"""The most ``"auto"`` keeps back from the measured room, in bytes (2 GiB)."""

_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded LONG_MAX


class HostBudgetError(MemoryError):
    """The host-memory budget cannot hold what must live in RAM (named, in bytes)."""


# ----------------------------------------------------------------------------- "auto"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _UNLIMITED else value


def _stat_field(path: Path, name: str) -> int:
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _mem_available(root: Path) -> int | None:
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_rooms(root: Path) -> list[int]:
    """Room (limit - usage + inactive file) of every cgroup level with a memory limit that
    this process sits in, v2 and v1; its own cgroup and each ancestor."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    rooms: list[int] = []
    base = root / "sys/fs/cgroup"
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2: 0::/path
            mount, limit_f, usage_f, inactive = base, "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):  # v1: N:memory:/path
            mount, limit_f, usage_f, inactive = (
                base / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
            )
        else:
            continue
        rel_parts = [p for p in rel.strip("/").split("/") if p]
        # the cgroup's own directory and every ancestor up to the mount (a container sees
        # its own cgroup at the mount's top, with /proc/self/cgroup naming the host path)
        dirs = [mount.joinpath(*rel_parts[:i]) for i in range(len(rel_parts), -1, -1)]
        for d in dirs:
            limit = _read_int(d / limit_f)
            if limit is None:
                continue
            usage = _read_int(d / usage_f)
            if usage is None:
                continue
            usage -= min(usage, _stat_field(d / "memory.stat", inactive))
            rooms.append(max(limit - usage, 0))
    return rooms


def cgroup_limited(root: str | os.PathLike[str] = "/") -> bool:
    """Whether a cgroup memory limit (v2 or v1, this process's cgroup or an ancestor)
    applies: ``page_cache="auto"`` then drops the pages disk-backed loads read."""
    return bool(_cgroup_rooms(Path(root)))


def host_room(root: str | os.PathLike[str] = "/") -> int | None:
    """Host memory new allocations can take now, in bytes: ``min(MemAvailable, every
    memory-limited cgroup level's limit - usage)`` (usage without its inactive file pages,
    which the kernel reclaims first), cgroup v2 and v1.

    Args:
        root: the file system root holding ``proc/`` and ``sys/fs/cgroup/`` (``"/"``; a
            fake tree in tests).

    Returns:
        The bytes, or None when neither ``/proc/meminfo`` nor a cgroup limit is readable.
    """
    base = Path(root)
    values = [v for v in [_mem_available(base), *_cgroup_rooms(base)] if v is not None]
    return min(values) if values else None


def reserve_bytes(room: int) -> int:
    """What ``"auto"`` keeps back from ``room`` bytes: a tenth, at most ``AUTO_RESERVE``."""
    return min(room // 10, AUTO_RESERVE)


def auto_host_budget(held_bytes: int = 0, root: str | os.PathLike[str] = "/") -> int:
    """The ``"auto"`` host-memory budget, in bytes: ``host_room(root)`` plus
    ``held_bytes`` (host copies the process already holds, in anonymous memory: they
    become the offload's host copies), minus ``reserve_bytes`` of that sum.

    Raises:
        HostBudgetError: the host memory cannot be measured (no ``/proc/meminfo``, no
            cgroup limit); give the budget in bytes instead.
    """
    room = host_room(root)
    if room is None:
        raise HostBudgetError(
            f"host_memory_budget='auto': cannot measure host memory (no {Path(root) / 'proc/meminfo'} "
            "and no cgroup memory limit); give the budget in bytes"
        )
    total = room + max(int(held_bytes), 0)
    return total - reserve_bytes(total)


def check_budget(value: object) -> int | str | None:
    """Validate a ``host_memory_budget``: an int number of bytes >= 0, ``"auto"`` or None.

    Raises:
        TypeError, ValueError: naming the field, the value and what is allowed.
    """
    if value is None or value == "auto":
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"host_memory_budget must be an int number of bytes, 'auto' or None, got {value!r}"
        )
    if value < 0:
        raise ValueError(f"host_memory_budget must be >= 0 bytes, got {value}")
    return value


# ----------------------------------------------------------------------------- file maps


_WRITTEN: dict[int, "weakref.ReferenceType[torch.UntypedStorage]"] = {}
"""Storages of file maps a disk tier wrote into (``id`` -> weak reference): no longer
file-backed for a later plan. An entry goes with its storage."""


def mark_written(t: torch.Tensor) -> None:
    """Note that a disk tier wrote into host tensor ``t``'s file map: its storage is no
    longer file-backed for a later plan (``FileMaps.backing``); the note goes with it."""
    storage = t.untyped_storage()
    key = id(storage)
    ref = _WRITTEN.get(key)
    if ref is not None and ref() is storage:
        return

    def forget(r: Any, key: int = key) -> None:
        if _WRITTEN.get(key) is r:
            del _WRITTEN[key]

    _WRITTEN[key] = weakref.ref(storage, forget)


def _was_written(storage: torch.UntypedStorage) -> bool:
    ref = _WRITTEN.get(id(storage))
    return ref is not None and ref() is storage


@dataclass(frozen=True)
class _Map:
    start: int
    end: int
    offset: int
    path: str


class FileMaps:
    """The process's private (copy-on-write) mappings of ``*.safetensors`` files, read
    from ``/proc/self/maps`` once: which host tensors are file-backed, and where.

    Args:
        maps: the text of ``/proc/self/maps`` (None: read it now; empty off Linux).
    """

    def __init__(self, maps: str | None = None) -> None:
        if maps is None:
            try:
                maps = Path("/proc/self/maps").read_text()
            except OSError:
                maps = ""
        entries: list[_Map] = []
        for line in maps.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 6 or parts[1][3] != "p" or not parts[5].endswith(".safetensors"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            entries.append(_Map(lo, hi, int(parts[2], 16), parts[5]))
        entries.sort(key=lambda m: m.start)
        self._maps = entries
        self._starts = [m.start for m in entries]

    def backing(self, t: torch.Tensor) -> tuple[str, int] | None:
        """``(file path, byte offset)`` of the file bytes a host tensor's whole storage
        maps, or None when it is not (wholly) a private map of a safetensors file, or
        when a disk tier wrote into it (``DiskTier.note_write``: its written pages are
        anonymous memory now, so it lives in RAM like any other written weight)."""
        if t.device.type != "cpu":
            return None
        storage = t.untyped_storage()
        if _was_written(storage):
            return None
        ptr, n = storage.data_ptr(), storage.nbytes()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if n == 0 or i < 0:
            return None
        m = self._maps[i]
        if not (m.start <= ptr and ptr + n <= m.end):
            return None
        return m.path, m.offset + ptr - m.start


# ----------------------------------------------------------------------------- the plan


@dataclass
class TierPlan:
    """Which host copies live in which tier, chosen at ``enable``.

    Attributes:
        budget: the host-memory budget, in bytes.
        ram_only_bytes: host copies that cannot be file-backed (they live in RAM).
        file_bytes: host copies whose weights are file-backed.
        disk_bytes: the file-backed ones left on disk (the rest of ``file_bytes`` is
            copied into RAM).
        staging_bytes: the pinned staging ring (0 without a disk tier).
        disk_ids: ``id`` of every tensor left on disk.
        overhead_bytes: the room set aside for the host copies' write-check buffers and
            arena padding (``check_bytes``: a bound, pinned where the host pins).
    """

    budget: int
    ram_only_bytes: int
    file_bytes: int
    disk_bytes: int
    staging_bytes: int
    disk_ids: set[int] = field(default_factory=set)
    overhead_bytes: int = 0

    @property
    def ram_bytes(self) -> int:
        """Host copies in RAM (pinned or pageable)."""
        return self.ram_only_bytes + self.file_bytes - self.disk_bytes

    def pinned_split(self, max_pinned_bytes: int | None = None) -> tuple[int, int]:
        """``(pinned, pageable)`` bytes of the host copies in RAM: pinned up to
        ``max_pinned_bytes`` (None: no cap), the rest pageable; the staging ring (pinned)
        is ``staging_bytes``, apart."""
        ram = self.ram_bytes
        pinned = ram if max_pinned_bytes is None else min(ram, max_pinned_bytes)
        return pinned, ram - pinned

    def line(self) -> str:
        """The one start line: which tier holds what, and why."""
        total = self.ram_only_bytes + self.file_bytes
        if not self.disk_bytes:
            return (
                f"host tiers: all {total} bytes of host copies in RAM (pinned, then pageable): "
                f"they fit the host budget of {self.budget} bytes; nothing read from disk"
            )
        return (
            f"host tiers: {self.ram_bytes} bytes of host copies in RAM (pinned, then pageable), "
            f"{self.disk_bytes} bytes left on disk (file-backed, read through a "
            f"{self.staging_bytes}-byte pinned staging ring at every load): the {total} bytes "
            f"exceed the host budget of {self.budget} bytes ({self.ram_only_bytes} of them "
            "cannot be file-backed)"
        )


FP_BLOCK = 512
"""Fingerprints (8 bytes each) per host buffer of a disk tier's write-check records."""


def check_bytes(groups: Iterable[Sequence[int]]) -> int:
    """A bound on the host memory the host copies cost beyond their own bytes, all of it
    pinned where the host pins, for ``groups``: the tensor sizes (bytes) of each unit
    packed into arenas of its own (a component; a block in layer mode).

    Per unit of ``g`` bytes: its RAM and its disk arena (at most two, plus one per
    ``ARENA_BYTES``) each read back ``4 * checksum.size`` bytes of write-check sums, at
    most ``4 * (checksum.size(g) + 8 * MIN_ROWS)`` or ``4 * 271`` (an arena under
    ``17 * 16`` bytes is read as it is); per tensor, its alignment padding (< ``ALIGN``)
    and a disk tier's fingerprint (8 bytes, in blocks of ``FP_BLOCK``); once, the pinned
    checksum weights for the widest arena (8 bytes a row, a power of two of rows:
    ``checksum.device_weights``)."""
    total = count = widest = 0
    for sizes in groups:
        g = sum(sizes)
        if not g:
            continue
        arenas = 2 + g // ARENA_BYTES
        part = min(g, ARENA_BYTES)
        sums = max(4 * (checksum.size(checksum.shape(part), part) + checksum.COLUMNS * checksum.MIN_ROWS),
                   4 * min(part, checksum.MIN_ROWS * 16 - 1))
        total += arenas * sums
        count += len(sizes)
        widest = max(widest, checksum.shape(part)[1])
    if not count:
        return 0
    weights = checksum.COLUMNS * (1 << max(widest - 1, 0).bit_length()) if widest else 0
    return total + weights + (ALIGN + 8) * count + 8 * FP_BLOCK


def _staging_bytes(budget: int, largest: int, spill: int) -> int:
    # a buffer (one pin: at most hostmem.PIN_CHUNK): one unit (block, component) or
    # tensor, at most STAGING_CHUNK, a quarter of
    # the budget (the ring is at most half of it) and the bytes that must leave RAM (a
    # large ring would push more weights to disk than it serves)
    chunk = max(min(STAGING_CHUNK, hostmem.PIN_CHUNK, budget // (2 * STAGING_COUNT), largest, spill), 4096)
    return STAGING_COUNT * chunk


def split_tiers(
    sizes: Sequence[tuple[int, bool]], budget: int, unit_bytes: int = 0, overhead: int = 0
) -> TierPlan:
    """The tier rule, on sizes alone (the backends through ``plan_tiers``, the planner on
    a model's tensor sizes): everything in RAM when it fits ``budget``; otherwise the
    host copies that cannot be file-backed stay in RAM, a staging ring is set aside, and
    file-backed ones are kept in RAM in order while they fit; the rest stay on disk.

    Args:
        sizes: per host copy, in order, ``(bytes, file-backed)``.
        budget: the host-memory budget in bytes.
        unit_bytes: the bytes of the largest unit loaded at once (``stage_unit``): a
            staging-ring buffer holds one when the budget allows (at most
            ``STAGING_CHUNK``, a quarter of the budget and the bytes that do not fit it),
            so the reader can read the next one ahead.
        overhead: the room set aside for the write checks' buffers and the arenas'
            padding (``check_bytes``), in bytes.

    Returns:
        The ``TierPlan``; its ``disk_ids`` are indices into ``sizes``.

    Raises:
        HostBudgetError: the host copies that cannot be file-backed, with the staging
            ring, exceed ``budget`` (both named, in bytes).
    """
    ram_only = sum(n for n, backed in sizes if not backed)
    backed = [(i, n) for i, (n, b) in enumerate(sizes) if b]
    file_bytes = sum(n for _, n in backed)
    if ram_only + file_bytes + overhead <= budget:
        return TierPlan(budget, ram_only, file_bytes, 0, 0, overhead_bytes=overhead)
    largest = max(max((n for _, n in backed), default=0), unit_bytes)
    staging = _staging_bytes(budget, largest, ram_only + file_bytes + overhead - budget)
    if ram_only + staging + overhead > budget:
        raise HostBudgetError(
            f"host_memory_budget={budget} bytes cannot hold the {ram_only} bytes of host "
            f"copies that cannot be file-backed (weights cast at load, fused with a LoRA, "
            f"quantized, from GGUF, built in memory or on the device at enable)"
            + (f" plus the {staging}-byte pinned staging ring" if backed else "")
            + f" and up to {overhead} bytes of write-check buffers and padding"
            + "; raise the budget, load the weights from safetensors in their stored dtype, "
            "or select fewer components"
        )
    room = budget - ram_only - staging - overhead
    disk_ids: set[int] = set()
    disk = 0
    for key, n in backed:
        if n <= room:
            room -= n
        else:
            disk_ids.add(key)
            disk += n
    return TierPlan(budget, ram_only, file_bytes, disk, staging, disk_ids, overhead)


def stage_unit(components: Iterable[Iterable[tuple[int, bool]]]) -> int:
    """The unit a staging-ring buffer is sized to in layer mode: the largest selected
    component's file-backed bytes (``sizes`` per component, as ``split_tiers`` takes)."""
    return max((sum(n for n, backed in c if backed) for c in components), default=0)


def plan_tiers(
    tensors: Iterable[torch.Tensor], budget: int, maps: FileMaps | None = None, unit_bytes: int = 0,
    device_bytes: int = 0, overhead: int = 0,
) -> TierPlan:
    """Choose the tier of every host copy the offload will hold (``split_tiers`` on the
    tensors' sizes; a tensor is file-backed when its whole storage is a private map of a
    safetensors file, ``FileMaps``).

    Args:
        tensors: the distinct tensors (payloads) that get host copies: the selected
            components' evictable weights.
        budget: the host-memory budget in bytes.
        maps: the process's file maps (None: read now).
        unit_bytes: as ``split_tiers``.
        device_bytes: the bytes of the host copies made for weights that are on the
            device at ``enable`` (their first eviction allocates them): RAM only.
        overhead: as ``split_tiers`` (``check_bytes`` of the packing units).

    Returns:
        The ``TierPlan``; its ``disk_ids`` are the ``id`` of every tensor left on disk.

    Raises:
        HostBudgetError: as ``split_tiers``.
    """
    maps = maps if maps is not None else FileMaps()
    items = list(tensors)
    sizes = [(t.numel() * t.element_size(), file_backed(t, maps)) for t in items]
    if device_bytes:
        sizes.append((device_bytes, False))  # last: never an index of ``items``
    plan = split_tiers(sizes, budget, unit_bytes, overhead)
    plan.disk_ids = {id(items[i]) for i in plan.disk_ids}
    return plan


def file_backed(t: torch.Tensor, maps: FileMaps) -> bool:
    """Whether host tensor ``t`` is its whole storage, a private map of a safetensors file."""
    return maps.backing(t) is not None and t.untyped_storage().nbytes() == t.numel() * t.element_size()
