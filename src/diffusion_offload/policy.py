"""The memory policy of model-level offload: what stays resident, what is prefetched, and
how a stage recovers from running out of device memory (SPEC section 11).

Without a budget (``device_memory_budget=None``, the default) the strict rule of SPEC
section 4 applies: a stage evicts every component its hook excludes, then loads its
group. With a budget (bytes, or ``"auto"``):

* **Keep what fits.** A stage evicts only what its group needs to fit within the budget,
  never the group about to run. Victims are chosen by *farthest next use* in the order of
  stages observed on the previous request (Belady's rule on a cyclic schedule): at the
  text encoder of a Wan2.2 request with room for two of its three components, it evicts
  ``transformer_2`` (used last) and keeps ``transformer`` (used next). Until a request
  has been observed, it evicts the least recently used first.
* **Prefetch the next stage.** Once a group is resident, the next group of the observed
  order is loaded on a copy stream while the current stage computes, if it fits within
  the budget beside the current group (after evicting, by the same rule, components
  used later than it). The next stage's hook waits on the copy's event.
* **Decode without the DiTs only when needed.** A VAE evicts the selected components
  before it runs only once a decode has run out of memory beside them (the retry's
  eviction, learned); strict mode evicts the selected DiTs always.
* **OOM recovery** (both modes): a device OOM inside a stage's forward evicts every
  selected component outside the running group, empties the device cache and retries
  the forward once; a second OOM raises ``StageOutOfMemoryError`` naming the stage, the
  resident weight bytes and the budget.

The budget bounds the bytes of component weights resident on the device (unselected
components included), not activations.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .platform import Platform

if TYPE_CHECKING:
    from .residency import ComponentWeights

__all__ = ["MemoryPolicy", "StageOutOfMemoryError", "resolve_budget"]

logger = logging.getLogger(__name__)

#: the activation reserve of ``"auto"``: max(10 % of the device's total memory, 1 GiB)
AUTO_RESERVE_FRACTION = 0.10
AUTO_RESERVE_MIN_BYTES = 1 << 30
#: a device reporting at least this total is treated as unlimited (the fake device
#: without a capacity reports 2**50 bytes)
UNLIMITED_TOTAL_BYTES = 1 << 50


class StageOutOfMemoryError(torch.OutOfMemoryError):
    """A stage ran out of device memory again after its one retry."""


def resolve_budget(
    budget: int | str | None, platform: Platform, already_resident: int = 0
) -> int | None:
    """The budget in bytes, or None for the strict rule.

    Args:
        budget: bytes (int >= 0), ``"auto"`` or None.
        platform: the device's platform (``memory_stats`` for ``"auto"``).
        already_resident: bytes of managed weights on the device now; ``"auto"`` counts
            them as available (they are what the budget is for).

    ``"auto"``: free device memory + ``already_resident`` - max(10 % of the device's
    total, 1 GiB). A device without a known total, or the fake device without a
    capacity, gives an unlimited budget (``sys.maxsize``).

    Raises:
        TypeError: not an int, ``"auto"`` or None.
        ValueError: a negative number of bytes, or another string.
    """
    if budget is None:
        return None
    if isinstance(budget, str):
        if budget != "auto":
            raise ValueError(
                f"device_memory_budget={budget!r} is not allowed; give bytes (an int), 'auto' or None"
            )
        stats = platform.memory_stats()
        if stats.total_bytes is None or stats.free_bytes is None or stats.total_bytes >= UNLIMITED_TOTAL_BYTES:
            import sys

            return sys.maxsize
        reserve = max(int(stats.total_bytes * AUTO_RESERVE_FRACTION), AUTO_RESERVE_MIN_BYTES)
        return max(stats.free_bytes + already_resident - reserve, 0)
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(
            f"device_memory_budget must be an int number of bytes, 'auto' or None, got {budget!r}"
        )
    if budget < 0:
        raise ValueError(f"device_memory_budget must be >= 0 bytes, got {budget}")
    return budget


class MemoryPolicy:
    """Residency decisions of one model-level backend (see the module docstring).

    Args:
        budget: resolved budget in bytes, or None (strict rule).
        platform: the device's platform.
        components: the backend's ``ComponentWeights`` by name.

    Attributes:
        history: the stages activated, consecutive repeats collapsed (stage keys are
            tuples of component names).
        decode_needs_room: a decode ran out of memory beside the DiTs: VAEs evict them.
        tight: stages that ran out of memory once; no prefetch runs beside them.
        prefetched: component name -> (event, stream) of a load in flight.
        retries: forwards retried after an OOM.
    """

    def __init__(
        self, budget: int | None, platform: Platform, components: dict[str, "ComponentWeights"]
    ) -> None:
        self.budget = budget
        self.platform = platform
        self.components = components
        self.history: list[tuple[str, ...]] = []
        self.decode_needs_room = False
        self.tight: set[tuple[str, ...]] = set()  # stages that ran out of memory once
        self._clock = itertools.count(1)
        self.last_used: dict[str, int] = {}
        self.copy_stream: Any = platform.new_stream() if budget is not None else None
        self.prefetched: dict[str, Any] = {}
        self.retries = 0

    @property
    def strict(self) -> bool:
        """True without a budget: the strict rule of SPEC section 4."""
        return self.budget is None

    # -- order ----------------------------------------------------------------------------

    def observe(self, stage: tuple[str, ...]) -> bool:
        """Record that ``stage`` (its group's component names) is about to run; True if it
        begins a new stage (not a repeat of the one running)."""
        now = next(self._clock)
        for name in stage:
            self.last_used[name] = now
        if self.history and self.history[-1] == stage:
            return False
        self.history.append(stage)
        if len(self.history) > 4096:  # keep the last requests only
            first = self.history[0]
            starts = [i for i, s in enumerate(self.history) if s == first]
            if len(starts) > 2:
                self.history = self.history[starts[-2]:]
        return True

    def group_of(self, stage: tuple[str, ...]) -> list["ComponentWeights"]:
        """The components of ``stage`` (its key is their sorted names)."""
        return [self.components[n] for n in stage if n in self.components]

    def _cycle(self) -> tuple[list[tuple[str, ...]], int] | None:
        """The previous request's stage order and the current position in it, or None.

        A request starts with the first stage ever observed (the text encoders, as a
        pipeline runs them); the previous request is the span between its last two
        starts.
        """
        if not self.history:
            return None
        first = self.history[0]
        starts = [i for i, s in enumerate(self.history) if s == first]
        if len(starts) < 2:
            return None
        prev = self.history[starts[-2]:starts[-1]]
        pos = len(self.history) - 1 - starts[-1]
        if pos >= len(prev):
            return None
        return prev, pos

    def next_use(self, name: str, ahead: int = 0) -> float:
        """Stages from ``ahead`` stages after the current one until component ``name``
        runs again, in the observed order (inf: not in a request). With no order observed
        yet, recency stands in (least recently used = farthest)."""
        cycle = self._cycle()
        if cycle is None:
            return -float(self.last_used.get(name, 0))  # LRU: least recent = largest
        order, pos = cycle
        n = len(order)
        start = pos + ahead
        for d in range(1, n + 1):
            if name in order[(start + d) % n]:
                return float(d)
        return float("inf")

    def next_stage(self) -> tuple[str, ...] | None:
        """The stage expected after the current one, from the observed order."""
        cycle = self._cycle()
        if cycle is None:
            return None
        order, pos = cycle
        return order[(pos + 1) % len(order)]

    # -- room ---------------------------------------------------------------------------

    def resident_bytes(self) -> int:
        """Bytes of managed weights on the device now (each shared storage once)."""
        device = self.platform.device
        seen: dict[int, int] = {}
        for comp in self.components.values():
            for slot in comp.slots:
                if id(slot) not in seen and slot.on_device(device):
                    seen[id(slot)] = slot.nbytes
        return sum(seen.values())

    def _missing(self, group: Sequence["ComponentWeights"]) -> int:
        device = self.platform.device
        seen: dict[int, int] = {}
        for comp in group:
            for slot in comp.slots:
                if slot.evictable and not slot.on_device(device):
                    seen[id(slot)] = slot.nbytes
        return sum(seen.values())

    def victims(
        self,
        keep: Sequence["ComponentWeights"],
        need: int,
        candidates: Sequence["ComponentWeights"],
        ahead: int = 0,
    ) -> list["ComponentWeights"]:
        """Components to evict so ``need`` more bytes fit within the budget, farthest next
        use (seen from ``ahead`` stages on) first; never one in ``keep``. May return all
        candidates and still not fit."""
        assert self.budget is not None
        keep_names = {c.name for c in keep}
        pool = [c for c in candidates if c.selected and c.resident and c.name not in keep_names]
        pool.sort(key=lambda c: self.next_use(c.name, ahead), reverse=True)
        over = self.resident_bytes() + need - self.budget
        out = []
        for comp in pool:
            if over <= 0:
                break
            out.append(comp)
            over -= comp.evictable_bytes
        return out

    # -- prefetch -------------------------------------------------------------------------

    def prefetch_next(
        self,
        running: Sequence["ComponentWeights"],
        groups: Callable[[tuple[str, ...]], Sequence["ComponentWeights"]],
    ) -> None:
        """Start loading the next stage's group on the copy stream while ``running``
        computes, when that moves exactly what the next stage would move anyway: the
        victims are those the farthest-next-use rule picks at the next stage, and the
        prefetch is skipped if they include the running group (it cannot leave while it
        runs) or the group does not fit within the budget."""
        if self.strict or self.copy_stream is None:
            return
        if tuple(sorted(c.name for c in running)) in self.tight:
            return  # its activations need the room
        nxt = self.next_stage()
        if nxt is None:
            return
        group = [c for c in groups(nxt) if c.selected and not c.resident and c.name not in self.prefetched]
        if not group:
            return
        need = self._missing(group)
        victims = self.victims(group, need, list(self.components.values()), ahead=1)
        running_names = {c.name for c in running}
        if any(v.name in running_names for v in victims):
            return
        freed = sum(v.evictable_bytes for v in victims)
        if self.resident_bytes() - freed + need > self.budget:  # type: ignore[operator]
            return
        for v in victims:
            v.evict()
        for comp in group:
            try:
                pending = comp.load_async(self.copy_stream)
            except torch.OutOfMemoryError:
                logger.info("no room to prefetch %s now; it loads when it runs", comp.name)
                return
            self.prefetched[comp.name] = pending

    def finish_prefetch(self, comp: "ComponentWeights") -> bool:
        """If ``comp`` was prefetched, make the current stream wait for it and complete the
        load; True if so."""
        pending = self.prefetched.pop(comp.name, None)
        if pending is None:
            return False
        comp.finish_load(pending)
        return True
