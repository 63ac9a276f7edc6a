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
* **Nothing outruns a copy.** When the outermost offloaded call that issued a prefetch
  returns (a decode that prefetched the next request's text encoder, a DiT step, the
  first text-encoder call; also when it raises), the compute stream waits on the copy's
  event (``stream.wait_event``: no host wait, no kernel) and every tensor the copy
  allocated gets ``record_stream(compute stream)``. Whatever runs next on that stream is
  ordered after the copy: the pipeline's read of its output, the caller's reads and
  writes between requests (``load_lora_weights`` + ``fuse_lora`` included), and code
  that replaces a prefetched weight (diffusers' layerwise casting), whose free then
  waits for the compute that read it. With nothing in flight this costs nothing; the
  copy still overlaps the call that issued it, and later calls of that stage queue
  behind it on the device.
* **No stale prefetch.** A component's load in flight is recorded on the component
  itself (``ComponentWeights.pending``), so whatever evicts it before its stage runs (the
  OOM retry, a stage order that changed) completes it first, and its stage loads it.
* **Decode without the DiTs only when needed.** A VAE evicts the selected components
  before it runs only once a decode has run out of memory beside them (the retry's
  eviction, learned); strict mode evicts the selected DiTs always.
* **OOM recovery** (both modes): a device OOM inside a stage's forward evicts every
  selected component outside the running group, empties the device cache and retries
  the forward once; a second OOM raises ``StageOutOfMemoryError`` naming the stage, the
  resident weight bytes and the budget.

The budget bounds the bytes of component weights resident on the device (unselected
components included, a tensor shared by several components counted once), not
activations. A tensor tied between two selected components stays on the device while
either of them is resident.

**The smallest workable budget** is the bytes that always stay on the device (unselected
components, tensors shared with them): nothing else has to be resident at rest.
``enable`` refuses a budget below it (``"auto"`` included, e.g. one that resolves to 0 on
a small device) with ``BudgetTooSmallError`` (a ValueError) naming both numbers and the
value given, before anything is adopted, pinned or moved.

**A stage bigger than the budget** (its group beside the bytes that always stay exceeds
it: a budget smaller than one DiT) still runs: its activation evicts every other selected
component, loads the group, and when the outermost offloaded call that ran it returns
(also when it raises), ``settle`` evicts until the resident weights are within the budget
again (farthest next use first). So from ``enable`` on, between stages and between
requests, the resident weights stay at or under the budget; only while such a stage
computes are they over it. ``enable`` leaves the selected encoders on the host when they do
not fit beside the bytes that always stay.

**Growth after enable** (a LoRA loaded into an unselected component, a bigger replaced
Parameter of one): the next activation takes the change in first, then the budget in
force (``MemoryPolicy.budget``) becomes max(the budget given, the bytes that always stay
now), with one ``RuntimeWarning`` naming both each time it rises to a new high; victims
and prefetches follow that budget, so the resident weights stay within it and ``audit()``
(which checks against it) stays ``[]``. A selected group that grows past the budget is a
stage bigger than the budget (above). When the growth goes (``unload_lora_weights``), the
next activation brings the budget given back. To bound the grown weights by a fixed
number instead, ``disable()`` and ``enable()`` with another budget.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from .platform import Platform

if TYPE_CHECKING:
    from .residency import ComponentWeights

__all__ = [
    "BlockSpec",
    "BudgetTooSmallError",
    "MemoryPolicy",
    "keep_blocks",
    "StageOutOfMemoryError",
    "resolve_budget",
    "smallest_budget",
]

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


class BudgetTooSmallError(ValueError):
    """``device_memory_budget`` is below the smallest budget that can run the pipeline.

    Module mode: the weights that always stay on the device (``group`` is 0; a stage
    bigger than the rest of the budget still runs, see the module docstring). Layer mode:
    those plus the double buffer of the two largest streamed blocks.

    Attributes:
        given: the budget as given (bytes or ``"auto"``).
        budget: the budget in bytes (what ``"auto"`` resolved to).
        smallest: the smallest workable budget in bytes.
        fixed: bytes of weights that always stay on the device (unselected components,
            tensors shared with them).
        group: layer mode: bytes of the two largest streamed blocks, ``group_names``
            their names; module mode: 0 and ``()``.
    """

    def __init__(
        self,
        given: Any,
        budget: int,
        smallest: int,
        fixed: int,
        group: int,
        group_names: tuple[str, ...],
        layer: bool = False,
    ) -> None:
        self.given, self.budget, self.smallest = given, budget, smallest
        self.fixed, self.group, self.group_names = fixed, group, group_names
        shown = f"{given!r} (resolved to {budget} bytes)" if isinstance(given, str) else f"{budget} bytes"
        if layer:  # layer mode: the group is the double buffer of the two largest blocks
            super().__init__(
                f"device_memory_budget={shown} is below the smallest workable budget of "
                f"{smallest} bytes: {fixed} bytes of weights that always stay on the device + "
                f"{group} bytes of the two largest streamed blocks {list(group_names)}; give "
                f"device_memory_budget >= {smallest}, or None (layer mode without a budget: "
                "trunks and two blocks)"
            )
            return
        super().__init__(
            f"device_memory_budget={shown} is below the smallest workable budget of {smallest} "
            f"bytes: the weights that always stay on the device (unselected components, tensors "
            f"shared with them); give device_memory_budget >= {smallest}, or None for the "
            "strict rule (one group at a time, no budget)"
        )


Slots = Iterable[tuple[frozenset[str], int, bool]]


def smallest_budget(
    slots: Slots, groups: Iterable[Iterable[str]]
) -> tuple[int, int, int, tuple[str, ...]]:
    """The smallest budget that runs every stage: ``(bytes, fixed, group, group_names)``.

    Args:
        slots: ``(owner names, bytes, evictable)`` per slot (each shared storage once).
        groups: the component names of each stage group.

    ``fixed`` is the bytes of the slots that never leave the device (not evictable);
    ``group`` the largest, over the groups, of the bytes of the evictable slots any of
    the group's components holds (all on the device while the group runs).
    """
    slots = list(slots)
    fixed = sum(n for _, n, evictable in slots if not evictable)
    best, names = 0, ()
    for g in groups:
        members = set(g)
        size = sum(n for owners, n, evictable in slots if evictable and owners & members)
        if size > best or not names:
            best, names = size, tuple(sorted(members))
    return fixed + best, fixed, best, names


#: a streamable block for ``keep_blocks``: (component name, position in it, bytes)
BlockSpec = tuple[str, int, int]


def _double_buffer(sizes: Sequence[int]) -> int:
    """Bytes of the two largest of ``sizes`` (what streams through the device at once)."""
    return sum(sorted(sizes, reverse=True)[:2])


def keep_blocks(blocks: Sequence[BlockSpec], calls: dict[str, int], room: int) -> list[int]:
    """Which streamed blocks a layer-mode budget keeps resident (indices into ``blocks``).

    Args:
        blocks: every streamable block: ``(component, position, bytes)``.
        calls: forward calls per component in one request (a component missing: 0).
        room: the budget minus the bytes that always stay on the device (trunks,
            resident layers, unselected components), in bytes.

    The kept blocks plus the two largest blocks left streaming (the running block and
    the prefetch) fit in ``room``. H2D per request, ``sum(calls x bytes)`` of the blocks
    left streaming, is minimised first: blocks are taken by calls per request, then by
    bytes, as many of each (calls, bytes) class as fit (exact when a component's blocks
    are equal in size, as in every DiT and text encoder the built-in table knows); a
    block that never runs is never kept. Ties (a class that fits only in part) spread
    the kept blocks: round-robin over the class's components, then evenly over each
    component's positions, so that every streamed block's copy has the compute of the
    blocks before it to hide behind. Deterministic: the same inputs give the same
    blocks (the planner predicts with it, ``planner/plan.py``).

    Returns:
        The indices of the kept blocks, ascending; [] when nothing fits beside the
        double buffer.
    """
    classes: dict[tuple[int, int], list[int]] = {}
    for i, (comp, _, nbytes) in enumerate(blocks):
        n = calls.get(comp, 0)
        if n > 0 and nbytes > 0:
            classes.setdefault((n, nbytes), []).append(i)
    streaming = [nbytes for _, _, nbytes in blocks]
    used = 0
    kept: list[int] = []
    for (_, nbytes), members in sorted(classes.items(), key=lambda kv: (-kv[0][0], -kv[0][1])):
        fit = 0
        for _ in members:
            rest = list(streaming)
            rest.remove(nbytes)
            if used + nbytes + _double_buffer(rest) > room:
                break
            streaming, used, fit = rest, used + nbytes, fit + 1
        if fit:
            kept += _spread([blocks[i] for i in members], members, fit)
    return sorted(kept)


def _spread(specs: Sequence[BlockSpec], indices: Sequence[int], count: int) -> list[int]:
    """``count`` of ``indices`` (blocks of equal calls and bytes): round-robin over their
    components (in order of first appearance), evenly over each one's positions."""
    by_comp: dict[str, list[int]] = {}
    for (comp, _, _), i in sorted(zip(specs, indices), key=lambda si: (si[0][1], si[1])):
        by_comp.setdefault(comp, []).append(i)
    order = list(dict.fromkeys(comp for comp, _, _ in specs))
    share = dict.fromkeys(order, 0)
    left = count
    while left:
        for comp in order:
            if left and share[comp] < len(by_comp[comp]):
                share[comp] += 1
                left -= 1
    out: list[int] = []
    for comp in order:
        members, k = by_comp[comp], share[comp]
        out += [members[int((j + 0.5) * len(members) / k)] for j in range(k)]
    return out


class MemoryPolicy:
    """Residency decisions of one model-level backend (see the module docstring).

    Args:
        budget: resolved budget in bytes, or None (strict rule).
        platform: the device's platform.
        components: the backend's ``ComponentWeights`` by name.

    Attributes:
        requested: the budget given (bytes), or None.
        budget: the budget in force (bytes): ``requested``, or the smallest workable
            budget when structural changes after enable (a LoRA) grew it past
            ``requested`` (see the module docstring); None under the strict rule.
        history: the stages activated, consecutive repeats collapsed (stage keys are
            tuples of component names).
        decode_needs_room: a decode ran out of memory beside the DiTs: VAEs evict them.
        tight: stages that ran out of memory once; no prefetch runs beside them.
        retries: forwards retried after an OOM.
    """

    def __init__(
        self,
        budget: int | None,
        platform: Platform,
        components: dict[str, "ComponentWeights"],
    ) -> None:
        self.requested = budget
        self.budget = budget
        self.platform = platform
        self.components = components
        self.history: list[tuple[str, ...]] = []
        self.decode_needs_room = False
        self.tight: set[tuple[str, ...]] = set()  # stages that ran out of memory once
        self._clock = itertools.count(1)
        self.last_used: dict[str, int] = {}
        self.copy_stream: Any = platform.new_stream() if budget is not None else None
        self._unordered: list["ComponentWeights"] = []  # prefetches no stream waits on yet
        self._warned_at = budget if budget is not None else 0
        self.retries = 0

    @property
    def strict(self) -> bool:
        """True without a budget: the strict rule of SPEC section 4."""
        return self.budget is None

    @property
    def prefetched(self) -> dict[str, Any]:
        """Component name -> ``PendingLoad`` of each load in flight (read from the
        components themselves, so an eviction, whoever makes it, never leaves a stale
        entry)."""
        return {n: c.pending for n, c in self.components.items() if c.pending is not None}

    def set_budget(self, budget: int | None) -> None:
        """Set the requested (and, until a growth raises it, the effective) budget in bytes."""
        self.requested = self.budget = budget
        self._warned_at = budget if budget is not None else 0

    def slots(self) -> list[tuple[frozenset[str], int, bool]]:
        """``(owners, bytes, evictable)`` of every managed slot now (shared ones once)."""
        seen: dict[int, tuple[frozenset[str], int, bool]] = {}
        for comp in self.components.values():
            for slot in comp.slots:
                if id(slot) not in seen:
                    seen[id(slot)] = (frozenset(slot.owners), slot.nbytes, slot.evictable)
        return list(seen.values())

    def fixed_bytes(self) -> int:
        """Bytes of the managed slots that never leave the device now (the smallest
        workable budget)."""
        return sum(n for _, n, evictable in self.slots() if not evictable)

    def refresh_budget(self) -> int | None:
        """Follow growth after enable: the budget in force becomes max(requested, the
        bytes that always stay on the device now), with one ``RuntimeWarning`` each time
        it rises to a new high; returns it. O(slots); called by each budgeted activation."""
        if self.requested is None:
            return None
        floor = self.fixed_bytes()
        effective = max(self.requested, floor)
        if effective > self._warned_at:
            self._warned_at = effective
            warnings.warn(
                f"device_memory_budget: the weights that always stay on the device grew after "
                f"enable() (a LoRA in an unselected component?) to {floor} bytes, above the "
                f"{self.requested} bytes given; running with a budget of {effective} bytes "
                "until they shrink again. To bound them, disable() and enable() with another "
                "budget, or offload more components",
                RuntimeWarning,
                stacklevel=6,
            )
        self.budget = effective
        return effective

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

    def projected_bytes(self, evict: Iterable[str] = (), load: Iterable[str] = ()) -> int:
        """Bytes of managed weights on the device after evicting the components named in
        ``evict`` and loading those in ``load``: the slots that never leave plus every
        evictable slot that a component resident afterwards holds (a slot shared with a
        component that stays resident does not leave with an evicted owner)."""
        device = self.platform.device
        gone = set(evict)
        after = {n for n, c in self.components.items() if c.resident and n not in gone} | set(load)
        seen: dict[int, int] = {}
        for comp in self.components.values():
            for slot in comp.slots:
                if id(slot) in seen:
                    continue
                if slot.evictable:
                    if not slot.owners.isdisjoint(after):
                        seen[id(slot)] = slot.nbytes
                elif slot.on_device(device):
                    seen[id(slot)] = slot.nbytes
        return sum(seen.values())

    def victims(
        self,
        keep: Sequence["ComponentWeights"],
        candidates: Sequence["ComponentWeights"],
        ahead: int = 0,
    ) -> list["ComponentWeights"]:
        """Components to evict so that ``keep`` fits beside what stays within the budget,
        farthest next use (seen from ``ahead`` stages on) first; never one in ``keep``.
        May return all candidates and still not fit: a stage bigger than the budget,
        which runs over it until ``settle`` evicts it."""
        assert self.budget is not None
        keep_names = {c.name for c in keep}
        pool = [c for c in candidates if c.selected and c.resident and c.name not in keep_names]
        pool.sort(key=lambda c: self.next_use(c.name, ahead), reverse=True)
        out: list["ComponentWeights"] = []
        gone: set[str] = set()
        for comp in pool:
            if self.projected_bytes(gone, keep_names) <= self.budget:
                break
            out.append(comp)
            gone.add(comp.name)
        return out

    def settle(self) -> list[str]:
        """Evict selected components, farthest next use first, until the resident weights
        are within the budget (after a stage bigger than the budget: the end of the
        outermost offloaded call that ran it). Returns the names evicted; [] (O(slots))
        when the weights already fit. No-op under the strict rule."""
        if self.budget is None or self.resident_bytes() <= self.budget:
            return []
        pool = [c for c in self.components.values() if c.selected and c.resident]
        pool.sort(key=lambda c: self.next_use(c.name), reverse=True)
        evicted: list[str] = []
        for comp in pool:
            if self.projected_bytes(evicted) <= self.budget:
                break
            comp.evict()
            evicted.append(comp.name)
        return evicted

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
        runs) or the group does not fit within the budget.

        The loads stay in flight until ``order_pending`` (the end of the outermost
        offloaded call, see ``hooks``) or their stage's hook orders the compute stream
        after them."""
        if self.strict or self.copy_stream is None:
            return
        if tuple(sorted(c.name for c in running)) in self.tight:
            return  # its activations need the room
        nxt = self.next_stage()
        if nxt is None:
            return
        group = [c for c in groups(nxt) if c.selected and not c.resident]
        if not group:
            return
        victims = self.victims(group, list(self.components.values()), ahead=1)
        running_names = {c.name for c in running}
        if any(v.name in running_names for v in victims):
            return
        if self.projected_bytes({v.name for v in victims}, {c.name for c in group}) > self.budget:  # type: ignore[operator]
            return
        for v in victims:
            v.evict()
        for comp in group:
            try:
                comp.load_async(self.copy_stream)
            except torch.OutOfMemoryError:
                logger.info("no room to prefetch %s now; it loads when it runs", comp.name)
                return
            self._unordered.append(comp)

    def order_pending(self) -> None:
        """Order the current stream after every prefetch still in flight (an event wait
        and ``record_stream`` per loaded tensor: no host wait, no kernel), so whatever
        runs next on it (the caller's reads and writes between requests, the pipeline's
        read of its output, a replacement of a prefetched weight) comes after the
        copies. O(1) when no prefetch is in flight unordered."""
        if not self._unordered:
            return
        comps, self._unordered = self._unordered, []
        for comp in comps:
            comp.order_pending()

