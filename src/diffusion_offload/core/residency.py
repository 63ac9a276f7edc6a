"""Residency of components: which tensors each component holds, and its all-or-nothing moves.

``WeightTable`` owns every slot of one backend, keyed by tensor object, so a tensor shared
by two components has one slot and one host copy. ``ComponentWeights`` is one pipeline
component: its slots, its residency flag, and its transactional ``load`` / ``evict``.

Structural changes are followed. Module attribute and registration changes (a
Parameter replaced, a submodule added: LoRA layers) bump the owning component's
``generation`` through torch's global registration hooks, so a hook sees a change in O(1)
while the component is resident. Every load and eviction also rescans the component's
tensors (it is O(tensors) anyway), which catches changes no hook reports (``del``,
direct ``_parameters`` writes): new tensors are adopted (host copy, pinned), dropped ones
released. A meta tensor is a ValueError naming the component and the tensor, raised
before anything moves.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .arena import Arena
from . import checks
from .platform import same_device
from .quantized import Carrier, UnsupportedTensorError, carriers, check_rebuild, module_carriers
from .transfer import Member, Mover, TensorSlot, Transaction, payload_of, record_on, storage_span

__all__ = ["ComponentWeights", "WeightTable", "named_carriers", "named_tensors"]


def _walk(module: nn.Module, skip: "weakref.WeakSet[nn.Module]", prefix: str = "") -> Iterable[tuple[str, nn.Module]]:
    """``named_modules(remove_duplicate=False)`` without the subtrees rooted in ``skip``."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is None or child in skip:
            continue
        yield from _walk(child, skip, f"{prefix}.{name}" if prefix else name)


def named_carriers(
    module: nn.Module,
    skip: "weakref.WeakSet[nn.Module] | None" = None,
    component: str | None = None,
) -> list[Carrier]:
    """The plain tensors that carry ``module``'s weights (``quantized.carriers``), each
    once, under its first dotted name in ``named_modules`` order.

    Every parameter and buffer (persistent or not) is a carrier itself, or, for a
    quantized weight, its inner tensors (a traceable wrapper subclass) or itself with
    its quantization state (bitsandbytes); a bitsandbytes ``Linear8bitLt``'s ``state``
    tensors are carriers too. A tensor registered in several places (tied weights)
    appears once. ``skip``: submodules whose subtrees are left out (layer mode's
    streamed blocks, which are components of their own). ``component``: the name the
    error message gives ``module``.

    Raises:
        quantized.UnsupportedTensorError (a TypeError): a weight of a format the mover
            cannot move (the component, the tensor's path, its class and the supported
            formats named).
    """
    registered: set[int] = set()
    seen: set[int] = set()
    out: list[Carrier] = []
    walk = module.named_modules(remove_duplicate=False) if not skip else _walk(module, skip)
    for prefix, sub in walk:
        found: list[Carrier] = []
        for store in (sub._parameters, sub._buffers):
            for name, t in store.items():
                if t is not None and id(t) not in registered:
                    registered.add(id(t))
                    try:
                        found.extend(carriers(f"{prefix}.{name}" if prefix else name, t))
                    except UnsupportedTensorError as exc:
                        if component is None:
                            raise
                        raise UnsupportedTensorError(f"component {component!r}: {exc}") from None
        found.extend(module_carriers(prefix, sub))
        for c in found:
            if id(c.tensor) not in seen:
                seen.add(id(c.tensor))
                out.append(c)
    return out


def named_tensors(
    module: nn.Module,
    skip: "weakref.WeakSet[nn.Module] | None" = None,
    component: str | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """Every distinct tensor that carries ``module``'s weights, with its first dotted
    name (``named_carriers``): for plain weights, every parameter and buffer object.

    Raises:
        quantized.UnsupportedTensorError: as ``named_carriers``.
    """
    return [(c.name, c.tensor) for c in named_carriers(module, skip, component)]


# ----------------------------------------------------------------------------- generations

_OWNERS: "weakref.WeakKeyDictionary[nn.Module, weakref.WeakSet[ComponentWeights]]" = (
    weakref.WeakKeyDictionary()
)
_hooks_installed = False


def _bump(module: nn.Module, name: str, value: Any) -> None:
    owners = _OWNERS.get(module)
    if owners:
        for comp in owners:
            comp.generation += 1


def _install_registration_hooks() -> None:
    """Bump generations on every parameter, buffer and submodule registration (once)."""
    global _hooks_installed
    if _hooks_installed:
        return
    from torch.nn.modules import module as torch_module

    torch_module.register_module_parameter_registration_hook(_bump)
    torch_module.register_module_buffer_registration_hook(_bump)
    torch_module.register_module_module_registration_hook(_bump)
    _hooks_installed = True


# ----------------------------------------------------------------------------- components


class ComponentWeights:
    """The tensors of one pipeline component and their residency (loads and evictions).

    Args:
        name: the component's name (e.g. ``"transformer"``), for messages and traces.
        role: ``"dit"``, ``"text_encoder"``, ``"encoder"``, ``"vae"``, ``"resident"`` or
            ``"part"``.
        selected: True if the config selects this component for offload.
        module: the component's module (held weakly).
        table: the backend's ``WeightTable``.
        skip: submodules whose tensors belong to other components (layer mode: a DiT's
            streamed blocks are not part of its resident trunk).

    Attributes:
        slots: the component's slots (shared slots appear in every owner).
        resident: True while the component's evictable tensors are on the device.
        generation: bumped by structural changes of the module tree; ``synced`` is the
            generation the slots reflect.
        listeners: callables ``(event, component, seconds)`` told of loads, evictions
            and structural syncs (``"load"``, ``"evict"``, ``"sync"``).
    """

    def __init__(
        self,
        name: str,
        role: str,
        selected: bool,
        module: nn.Module,
        table: "WeightTable",
        skip: Iterable[nn.Module] = (),
    ) -> None:
        self.name = name
        self.skip: "weakref.WeakSet[nn.Module]" = weakref.WeakSet(skip)
        self.role = role
        self.selected = selected
        self.module_ref = weakref.ref(module)
        self.table = table
        self.slots: list[TensorSlot] = []
        self.resident = not selected
        self.generation = 0
        self.synced = 0
        self.listeners: list[Callable[[str, "ComponentWeights", float], None]] = []
        self.pending: PendingLoad | None = None  # an asynchronous load in flight
        # the host buffer of the last ``checks.record`` and the arenas it was for
        self._sums: tuple[tuple[int, ...], torch.Tensor] | None = None
        weakref.finalize(module, _drop_slots, weakref.ref(self))

    @property
    def mover(self) -> Mover:
        """The backend's mover."""
        return self.table.mover

    @property
    def nbytes(self) -> int:
        """Bytes of all the component's tensors (shared ones included)."""
        return sum(s.nbytes for s in self.slots)

    @property
    def evictable_bytes(self) -> int:
        """Bytes that leave the device when this component is evicted."""
        return sum(s.nbytes for s in self.slots if s.evictable)

    @property
    def transfer_bytes(self) -> int:
        """Bytes one load of every evictable tensor copies host->device: each arena whole
        (its 16-byte alignment padding included), every other slot by itself."""
        arenas = {id(s.arena): s.arena.nbytes for s in self.slots if s.evictable and s.arena is not None}
        return sum(arenas.values()) + sum(s.nbytes for s in self.slots if s.evictable and s.arena is None)

    @property
    def ready(self) -> bool:
        """Resident, no load in flight, no structural change pending: nothing to do before
        it runs (O(1))."""
        return self.resident and self.pending is None and self.generation == self.synced

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The component's tensors now (``named_tensors`` of its module, ``skip`` left out)."""
        module = self.module_ref()
        return [] if module is None else named_tensors(module, self.skip, self.name)

    def _count(self, event: str, start: float) -> None:
        """Count a load or eviction that moved something (``start``: its perf_counter)."""
        seconds = time.perf_counter() - start
        stats = self.mover.stats
        if event == "load":
            stats.loads += 1
        else:
            stats.evictions += 1
        stats.transfer_seconds += seconds
        for listener in self.listeners:
            listener(event, self, seconds)

    def _register_modules(self) -> None:
        module = self.module_ref()
        if module is None:
            return
        for _, sub in _walk(module, self.skip):
            owners = _OWNERS.get(sub)
            if owners is None:
                owners = _OWNERS[sub] = weakref.WeakSet()
            owners.add(self)

    def sync(self, txn: Transaction) -> None:
        """Follow structural changes: adopt new tensors, release dropped ones.

        Raises:
            ValueError: a new tensor is on the meta device or on a foreign device; nothing
                was changed.
        """
        module = self.module_ref()
        if module is None:
            return
        generation = self.generation
        current = self.named_tensors()
        known = {id(m.obj) for s in self.slots for m in s.members}
        fresh = [(n, t) for n, t in current if id(t) not in known]
        ids = {id(t) for _, t in current}
        dropped = [
            s for s in self.slots if not any(id(m.obj) in ids for m in s.members)
        ]
        if fresh:
            self.table.adopt({self.name: fresh}, txn)
        for slot in dropped:
            self.table.disown(self.name, slot, txn)
        if fresh or dropped:
            self._register_modules()
            for listener in self.listeners:
                listener("sync", self, 0.0)  # not a transfer: nothing counted
        previous = self.synced
        self.synced = generation
        txn.on_rollback(lambda: setattr(self, "synced", previous))

    def load_slots(self, txn: Transaction) -> tuple[int, list[Arena], list[Member]]:
        """Copy every slot not on the device there (on the current stream), within ``txn``:
        each arena whose slots are all off the device in one H2D copy
        (``Mover.load_arena``), any other slot by itself.

        Returns:
            ``(H2D bytes, arenas loaded whole, members of slots loaded by themselves)``.
        """
        mover = self.mover
        device = mover.device
        waiting: dict[int, tuple[Arena, int]] = {}
        for slot in self.slots:
            if slot.arena is not None and not slot.on_device(device):  # evictable, or a kept host copy
                arena, n = waiting.get(id(slot.arena), (slot.arena, 0))
                waiting[id(arena)] = (arena, n + 1)
        moved = 0
        arenas: list[Arena] = []
        for arena, n in waiting.values():
            # an arena whose weights had their ``.data`` replaced while resident (layerwise
            # casting does it on every forward) loads tensor by tensor from then on: the
            # replaced ones' old bytes would otherwise stay allocated until the eviction
            if n == len(arena.slots) and all(not s.rebinds for s in arena.slots):
                moved += mover.load_arena(arena, txn)
                arenas.append(arena)
        singles: list[Member] = []
        for slot in self.slots:
            if slot.evictable or (slot.arena is not None and slot.host is not None):
                n = mover.load(slot, txn)
                if n:
                    singles.extend(slot.members)
                moved += n
            elif not slot.on_device(device):
                moved += mover.place(slot, txn)
        return moved, arenas, singles

    def record_checks(self) -> None:
        """Record the write-check sums of every arena of the component loaded whole and
        not recorded yet (``checks.record``), on the current stream: one product an arena,
        one asynchronous copy back of all of them, no host wait; and the fingerprints of
        every disk-backed slot loaded by itself (``disktier.DiskTier.record``: its host copy
        is then not read again by the check at eviction). No device room for the sums:
        nothing more is recorded (the members are then compared with their host copies)."""
        disk = self.mover.disk
        todo: dict[int, tuple[Arena, torch.Tensor]] = {}
        for slot in self.slots:
            a = slot.arena
            if disk is not None and a is None:
                try:
                    disk.record(slot)
                except torch.OutOfMemoryError:
                    return
            if a is None or a.checked or a.device_key is None:
                continue
            todo.setdefault(id(a), (a, slot.members[0].payload))
        self._record(list(todo.values()))

    def record_disk_sums(self, arenas: list[Arena]) -> None:
        """Layer mode's loads: record the sums of each disk arena of ``arenas`` (just
        loaded whole) that has no host sums yet (``checks.record``, on the current stream,
        no host wait): they stand for its host copies from then on, so its write checks
        never read the files again."""
        self._record([(a, a.slots[0].members[0].payload) for a in arenas
                      if a.on_disk and a.host_sums is None and a.slots])

    def _record(self, items: list[tuple[Arena, torch.Tensor]]) -> None:
        """``checks.record`` of ``items``, reusing the host buffer of the last call for the
        same arenas; no device room: nothing recorded (compared one by one later)."""
        if not items:
            return
        key = tuple(id(a) for a, _ in items)
        buf = self._sums[1] if self._sums is not None and self._sums[0] == key else None
        try:
            buf = checks.record(self.mover.stats, items, self.mover.platform, buf)
        except torch.OutOfMemoryError:
            return
        self._sums = (key, buf)

    def changed(self, slots: list[TensorSlot]) -> list[bool]:
        """Per member of ``slots`` (resident, about to leave), whether its device bytes
        differ from its host copy (``checks.changed``); every member when the device has
        no room left even for the check's temporaries (written back: correct, costs D2H)."""
        pairs = [(s, m) for s in slots for m in s.members]
        stats = self.mover.stats
        if pairs:
            stats.device_checks += 1
        try:
            disk = self.mover.disk  # disk-backed host copies: fingerprints of their loads
            recorded = None if disk is None else disk.recorded
            return checks.changed(stats, pairs, self.mover.platform, recorded)
        except torch.OutOfMemoryError:
            return [True] * len(pairs)

    def load(self) -> int:
        """Make every tensor of the component device-resident; return the H2D bytes.

        The copies are queued on the current stream with the write check's sums after
        them; nothing waits for them on the host (the stream orders the compute after).
        All or nothing: on any exception (``KeyboardInterrupt`` included) every tensor
        loaded by this call is put back on the host and its device copy freed at once.

        Raises:
            torch.OutOfMemoryError: the device cannot hold the component (named).
            ValueError: a new tensor is a meta tensor (see ``sync``).
        """
        start = time.perf_counter()
        txn = Transaction()
        try:
            self.sync(txn)
            moved, _, _ = self.load_slots(txn)
            if moved:
                self.record_checks()
        except torch.OutOfMemoryError as exc:
            txn.rollback()
            raise torch.OutOfMemoryError(
                f"out of device memory while loading component {self.name!r} "
                f"({self.nbytes} bytes): {exc}"
            ) from exc
        except BaseException:
            txn.rollback()
            raise
        txn.commit()
        self.resident = True
        if moved:
            self._count("load", start)
        return moved

    def load_async(self, stream: Any) -> "PendingLoad":
        """Queue the component's load on ``stream`` (a copy stream) and return at once.

        The H2D copies and the write check's sums are queued on ``stream``, followed by
        an event. Until ``finish_load`` the component is ``resident`` but not ``ready``:
        nothing may read its weights before the consuming stream waits on that event
        (``finish_load`` does). All or nothing.

        Raises:
            torch.OutOfMemoryError: no room for the component (nothing stays loaded).
        """
        start = time.perf_counter()
        mover = self.mover
        platform = mover.platform
        txn = Transaction()
        try:
            with platform.use_stream(stream):
                self.sync(txn)
                moved, arenas, singles = self.load_slots(txn)
                if moved:
                    self.record_checks()
                event = platform.new_event()
                if event is not None:
                    event.record(stream)
        except BaseException:
            if stream is not None:
                stream.synchronize()  # no copy may still write what the rollback frees
            txn.rollback()
            raise
        txn.commit()
        self.resident = True
        loaded = [m for a in arenas for s in a.slots for m in s.members] + singles
        self.pending = PendingLoad(loaded, event)
        mover.stats.prefetches += 1
        if moved:
            self._count("load", start)
        return self.pending

    def order_pending(self, stream: Any = None) -> None:
        """Order ``stream`` (None: the current stream) after the load in flight, without a
        host wait: ``stream.wait_event`` on the load's event, then ``record_stream(stream)``
        on every tensor it loaded (they were allocated on the copy stream, so freeing them
        later, whoever replaces them, waits for ``stream``'s work queued by then). No-op
        without a load in flight or when already ordered on that stream."""
        pending = self.pending
        if pending is None:
            return
        platform = self.mover.platform
        if stream is None:
            stream = platform.current_stream()
        key = _stream_key(stream)
        if stream is None or key in pending.ordered:
            return
        if pending.event is not None:
            stream.wait_event(pending.event)
        record_on(stream, pending.members, self.mover.device)
        pending.ordered.add(key)

    def finish_load(self, pending: "PendingLoad") -> None:
        """Order the current stream after a ``load_async`` (``order_pending``); no host
        wait. No-op if ``pending`` is not this component's load in flight."""
        if self.pending is not pending:
            return
        self.order_pending()
        self.pending = None

    def finish_pending(self) -> bool:
        """Complete the load in flight, if any (``finish_load``); True if there was one."""
        pending = self.pending
        if pending is None:
            return False
        self.finish_load(pending)
        return True

    def _kept_for_others(self, slot: TensorSlot) -> bool:
        """Whether another owner of ``slot`` is resident (the slot then stays on the device)."""
        comps = self.table.components
        return any(
            o != self.name and o in comps and comps[o].resident for o in slot.owners
        )

    def evict(self) -> int:
        """Point every evictable tensor back at its host copy; return the tensors moved.

        Unselected components never evict; tensors shared with resident components stay
        (a tensor tied between two selected components stays on the device while the
        other owner is resident). A load in flight is completed first. Unmodified tensors
        cost no copy; modified ones are written back first. An evicted
        component with a pending structural change is synced too, so tensors added to it
        on the device leave. All or nothing, for any exception: on failure every tensor is
        where it was.
        """
        if not self.selected or not (self.resident or self.generation != self.synced):
            return 0
        self.finish_pending()
        start = time.perf_counter()
        mover = self.mover
        txn = Transaction()
        try:
            self.sync(txn)  # tensors added while evicted may sit on the device
            on_device = [
                s for s in self.slots
                if s.evictable and s.on_device(mover.device) and not self._kept_for_others(s)
            ]
            mover.evict(on_device, txn, self.changed(on_device))
        except BaseException:
            txn.rollback()
            raise
        txn.commit()
        self.resident = False
        if on_device:
            self._count("evict", start)
        return len(on_device)

    def __repr__(self) -> str:
        state = "resident" if self.resident else "host"
        return f"ComponentWeights({self.name!r}, role={self.role!r}, {state})"


def _stream_key(stream: Any) -> Any:
    """A stable identity of a stream (``torch.cuda.current_stream()`` returns a new Python
    object on each call): its device and id where it has them."""
    if stream is None:
        return None
    sid = getattr(stream, "stream_id", None)
    if sid is None:
        return id(stream)
    return (getattr(stream, "device_type", None), getattr(stream, "device_index", None), sid)


class PendingLoad:
    """An asynchronous component load in flight: the tensors it loaded, the event
    recorded after them (and after the write check's sums), and the ids (``_stream_key``)
    of the streams already ordered after it (``ComponentWeights.order_pending``)."""

    __slots__ = ("members", "event", "ordered")

    def __init__(self, members: list[Any], event: Any) -> None:
        self.members = members
        self.event = event
        self.ordered: set[Any] = set()


def _span_bytes(objs: list[torch.Tensor]) -> list[int]:
    """Bytes of the host slots ``Mover._adopt_host`` makes for tensors viewing one storage
    (``transfer.storage_span``; one slot per tensor when the aliases do not tile)."""
    span = storage_span([payload_of(o) for o in objs])
    if span is None:
        return [n for o in objs for n in _span_bytes([o])]
    return [span[1] - span[0]]


def _owners(
    named: dict[str, list[tuple[str, torch.Tensor]]],
) -> tuple[dict[int, set[str]], dict[int, torch.Tensor]]:
    """Per tensor (by id): the names of the components that hold it, and the tensor."""
    owners: dict[int, set[str]] = {}
    objs: dict[int, torch.Tensor] = {}
    for comp, tensors in named.items():
        for _, t in tensors:
            owners.setdefault(id(t), set()).add(comp)
            objs[id(t)] = t
    return owners, objs


def _drop_slots(ref: "weakref.ref[ComponentWeights]") -> None:
    """The component's module was deleted: release its tensors (and their device copies)."""
    comp = ref()
    if comp is None:
        return
    txn = Transaction()
    for slot in list(comp.slots):
        comp.table.disown(comp.name, slot, txn)
    txn.commit()
    comp.resident = not comp.selected
    comp.pending = None


class WeightTable:
    """Every slot of one backend, keyed by tensor object; the components that own them.

    Args:
        mover: the backend's mover.
        shared_evictable: whether a tensor held by several selected components may be
            evicted (the backend: yes, it follows whichever owner runs); ``PartSwitcher``
            keeps tensors shared between parts resident.
    """

    def __init__(self, mover: Mover, shared_evictable: bool = True) -> None:
        self.mover = mover
        self.shared_evictable = shared_evictable
        self.components: dict[str, ComponentWeights] = {}
        self._slot_of: dict[int, TensorSlot] = {}

    def add(
        self,
        name: str,
        role: str,
        selected: bool,
        module: nn.Module,
        skip: Iterable[nn.Module] = (),
    ) -> ComponentWeights:
        """Register a component (no tensor is adopted until ``adopt``); ``skip``: submodules
        whose tensors are not the component's (see ``ComponentWeights``)."""
        _install_registration_hooks()
        comp = ComponentWeights(name, role, selected, module, self, skip)
        self.components[name] = comp
        return comp

    def slot_of(self, t: torch.Tensor) -> TensorSlot | None:
        """The slot that manages tensor object ``t``, or None."""
        return self._slot_of.get(id(t))

    def check_tensors(self, named: dict[str, list[tuple[str, torch.Tensor]]]) -> None:
        """Reject meta tensors and tensors on foreign devices, before anything moves.

        Raises:
            ValueError: naming the component, the tensor and its device.
        """
        device = self.mover.device
        for comp, tensors in named.items():
            for tname, t in tensors:
                p = payload_of(t)
                if p.is_meta:
                    raise ValueError(
                        f"component {comp!r}: tensor {tname!r} {tuple(p.shape)} is on the meta "
                        "device (never materialized); load its weights before enabling offload"
                    )
                if p.device.type != "cpu" and not same_device(p.device, device):
                    raise ValueError(
                        f"component {comp!r}: tensor {tname!r} is on {p.device}; offload to "
                        f"{device} handles tensors on the host or on {device} only"
                    )

    def plan(
        self, named: dict[str, list[tuple[str, torch.Tensor]]], selected: dict[str, bool]
    ) -> list[tuple[frozenset[str], int, bool]]:
        """The slots ``adopt`` would make for ``named`` in an empty table, without making
        them (no host copy, no pinning, no move): ``(owners, bytes, evictable)`` each.

        It groups tensors as ``adopt`` and ``Mover.group`` do: by owner set, then host
        tensors by storage, one span per storage (aligned to the largest element size, one
        slot per tensor when aliases of several element sizes do not tile), a device
        tensor one slot of its own bytes. ``selected``: component name -> selected.
        """
        owners, objs = _owners(named)
        fresh: dict[frozenset[str], list[torch.Tensor]] = {}
        for key, t in objs.items():
            fresh.setdefault(frozenset(owners[key]), []).append(t)
        out: list[tuple[frozenset[str], int, bool]] = []
        for names, group in fresh.items():
            evictable = all(selected[n] for n in names) and (len(names) == 1 or self.shared_evictable)
            host: dict[int, list[torch.Tensor]] = {}
            for t in group:
                p = payload_of(t)
                if p.device.type == "cpu":
                    host.setdefault(p.untyped_storage().data_ptr() or id(p), []).append(t)
                else:
                    out.append((names, p.numel() * p.element_size(), evictable))
            for same_storage in host.values():
                out.extend((names, n, evictable) for n in _span_bytes(same_storage))
        return out

    def adopt(
        self, named: dict[str, list[tuple[str, torch.Tensor]]], txn: Transaction, pack: bool = False
    ) -> None:
        """Give the components in ``named`` these tensors (new ones get slots and host copies).

        A tensor already managed (shared with another component) gains an owner; a slot is
        evictable only when every owner is selected. New evictable tensors get host copies
        (pinned when allowed); new non-evictable ones are placed on the device. With
        ``pack`` (``enable``) the host copies of each component's own evictable tensors are
        packed into arenas (``Mover.pack``); tensors adopted later (a LoRA layer added
        after ``enable``) keep host copies of their own until the next ``enable``.
        """
        self.check_tensors(named)
        owners, objs = _owners(named)
        touched: list[TensorSlot] = []
        # new tensors grouped by who owns them: tensors of different components never
        # share a slot, even when they view one storage (each gets its own span of it)
        fresh: dict[frozenset[str], list[torch.Tensor]] = {}
        for key, t in objs.items():
            slot = self._slot_of.get(key)
            if slot is not None:
                self._own(slot, owners[key], txn)
                touched.append(slot)
            else:
                fresh.setdefault(frozenset(owners[key]), []).append(t)
        outers = self._outers(named)
        for names, group in fresh.items():
            evictable = self._evictable(set(names))
            for slot in self.mover.group(group, txn, evictable, pack=pack and len(names) == 1, outers=outers):
                for m in slot.members:
                    self._slot_of[id(m.obj)] = slot
                txn.on_rollback(lambda s=slot: self._forget(s))
                self._own(slot, names, txn)
                if not evictable:
                    self.mover.place(slot, txn)
        for slot in touched:
            if slot.evictable and not self._evictable(slot.owners):
                slot.evictable = False
                txn.on_rollback(lambda s=slot: setattr(s, "evictable", True))

    def _outers(self, named: dict[str, list[tuple[str, torch.Tensor]]]) -> dict[int, tuple[torch.Tensor, ...]]:
        """Per inner tensor (by id) of a quantized wrapper subclass among the components
        in ``named``: its wrappers, innermost first (``Member.outers``). Each wrapper is
        checked to rebuild (``quantized.check_rebuild``) before anything moves.

        Raises:
            quantized.UnsupportedTensorError: a wrapper that cannot be rebuilt (named).
        """
        out: dict[int, tuple[torch.Tensor, ...]] = {}
        checked: set[int] = set()
        for name in named:
            comp = self.components.get(name)
            module = comp.module_ref() if comp is not None else None
            if module is None:
                continue
            for c in named_carriers(module, comp.skip):
                if not c.outers:
                    continue
                out[id(c.tensor)] = c.outers
                path = c.name
                for outer in c.outers:
                    path = path.rpartition(".")[0]
                    if id(outer) not in checked:
                        checked.add(id(outer))
                        check_rebuild(f"{name}: {path}", outer)
        return out

    def _evictable(self, owners: set[str]) -> bool:
        if len(owners) > 1 and not self.shared_evictable:
            return False
        return all(self.components[n].selected for n in owners)

    def _own(self, slot: TensorSlot, names: Iterable[str], txn: Transaction) -> None:
        for name in names:
            if name in slot.owners:
                continue
            slot.owners.add(name)
            comp = self.components[name]
            comp.slots.append(slot)

            def undo(slot: TensorSlot = slot, name: str = name, comp: ComponentWeights = comp) -> None:
                slot.owners.discard(name)
                comp.slots.remove(slot)

            txn.on_rollback(undo)

    def _forget(self, slot: TensorSlot) -> None:
        for m in slot.members:
            if self._slot_of.get(id(m.obj)) is slot:
                del self._slot_of[id(m.obj)]

    def disown(self, name: str, slot: TensorSlot, txn: Transaction) -> None:
        """Component ``name`` no longer holds ``slot``; a slot nobody holds is released."""
        comp = self.components[name]
        comp.slots.remove(slot)
        slot.owners.discard(name)
        if not slot.owners:
            self._forget(slot)
            self.mover.release(slot)

        def undo() -> None:
            if not slot.owners:
                for m in slot.members:
                    self._slot_of[id(m.obj)] = slot
                self.mover.unrelease(slot)
            slot.owners.add(name)
            comp.slots.append(slot)

        txn.on_rollback(undo)
