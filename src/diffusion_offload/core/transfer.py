"""Weight moves: one authoritative host copy per storage, and the moves between it and the device.

``TensorSlot`` is one host storage span and the tensor objects that view it (a tensor,
its ties, and Parameters that alias one storage share one slot, so they keep one host
copy and stay aliased). ``Mover`` performs every load and eviction on every platform the
same way, inside a ``Transaction`` that can put every tensor back, and counts what it
moves in the engine's counters (``stats.TransferStats``).

The rules (SPEC section 4, robustness contract):

* **The move primitive is ``tensor.data = payload``** (``_rebind``). The module keeps the
  same Python object for each parameter and buffer (identity, ties, ``torch.compile``
  guards hold), and the move works whoever else references the tensor: a live autograd
  graph, a weakref from compiled code, a user variable. ``torch.utils.swap_tensors``
  refuses all three. On CUDA/XPU/NPU ``set_data`` does this natively; the fake
  accelerator (``testing.fake_accelerator``) gives ``.data`` the same behaviour.
* Each evictable storage has exactly one host copy. At ``enable`` the host copies of
  each component's own tensors are packed into arenas (``arena``, ``Mover.pack``): one
  pinned buffer of at most 1 GiB each, filled storage by storage, so a load is one H2D
  copy per arena into one device allocation whose views the tensors become, freed
  together. Other host copies (tensors shared between components, adopted after
  ``enable``) are the original storage's span, pinned in place when asked and supported
  (``hostmem``); a tensor on the device when it is adopted is copied to the host once,
  then. Evicting an unmodified tensor rebinds it to its host view (no device->host
  copy), which frees the device copy at once.
* **Writes are found by comparing bytes** (``checks``): an arena's row and column sums
  are computed on the device after its copy and copied back without waiting, then
  computed again and read back when it leaves (one host wait); what differs, or is not
  covered by an arena, is compared with its host copy by fingerprints. A tensor whose dtype/shape changed or whose bytes differ is
  written back. ``.data`` in-place ops (invisible to ``_version``), ``.data``
  reassignment to equal bytes (layerwise casting: no write-back) and to new bytes
  (written back), and in-place ops that leave the bytes as they were (``add_(0)``: no
  write-back) are all decided by the bytes themselves.
* Moves run with inference mode and autograd off, so host and device copies are
  ordinary tensors even when the caller is inside ``torch.inference_mode()``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from . import hostmem
from .arena import ARENA_BYTES, Arena, layout
from .platform import Platform, same_device
from .quantized import refresh
from .stats import TransferStats

__all__ = [
    "Member",
    "Mover",
    "TensorSlot",
    "Transaction",
    "payload_of",
]


def _restore(arena: Arena, loaded: tuple[int | None, bool]) -> None:
    arena.device_key, arena.checked = loaded


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_DTENSOR: list[type | None] = []  # resolved once: DTensor, or None without distributed


def _is_dtensor(t: torch.Tensor) -> bool:
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except Exception:  # torch built without distributed
            DTensor = None  # noqa: N806
        _DTENSOR.append(DTensor)
    cls = _DTENSOR[0]
    return cls is not None and isinstance(t, cls)


def payload_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose payload moves: a DTensor's local shard, or ``t`` itself."""
    return t._local_tensor if _is_dtensor(t) else t


# ----------------------------------------------------------------------------- slots


class Member:
    """One tensor object that views a slot's storage.

    Attributes:
        obj: the object the modules hold (a Parameter or buffer, or a DTensor's local
            shard, or an inner tensor of a quantized wrapper subclass); its identity
            never changes.
        dtype, shape, stride: the view's metadata in the host copy.
        offset: storage offset, in elements of ``dtype``, from the slot's span start.
        outers: the wrapper subclasses ``obj`` is an inner tensor of, innermost first
            (``quantized.Carrier.outers``); brought to ``obj``'s device after each move
            (``quantized.refresh``). Empty for every other tensor.
    """

    __slots__ = ("obj", "dtype", "shape", "stride", "offset", "outers")

    def __init__(
        self,
        obj: torch.Tensor,
        offset: int,
        stride: tuple[int, ...],
        outers: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.obj = obj
        self.outers = outers
        p = payload_of(obj)
        self.dtype = p.dtype
        self.shape = tuple(p.shape)
        self.stride = stride
        self.offset = offset

    @property
    def payload(self) -> torch.Tensor:
        """The tensor whose data moves (``obj`` or its DTensor shard)."""
        return payload_of(self.obj)

    @property
    def nbytes(self) -> int:
        """Bytes of the current payload (numel x element size)."""
        return _nbytes(self.payload)


class TensorSlot:
    """One host storage span (the authoritative host copy) and the tensors that view it.

    Attributes:
        members: the tensor objects viewing the span (one, or several tied/aliased ones).
        evictable: False when a member is shared with a component that must stay
            resident; such a slot never leaves the device.
        host: the host copy: a flat ``uint8`` tensor of ``nbytes`` bytes (a span of the
            original storage when the weights were on the host, pinned in place when
            possible; otherwise a fresh host buffer). None for a non-evictable slot placed
            on the device for good.
        pinned: whether ``host`` is in pinned memory.
        nbytes: bytes of the span (moved host->device once per load).
        owners: names of the components that hold the slot.
        arena: the ``Arena`` whose buffer holds ``host``, or None (a host copy of its own).
        rebinds: set when a write check found a member's ``.data`` reassigned while
            resident (diffusers' layerwise casting does it on every forward): its arena
            then loads tensor by tensor, so a replaced tensor's old bytes are freed at once.
    """

    __slots__ = ("members", "evictable", "host", "pinned", "nbytes", "owners", "arena", "rebinds")

    def __init__(
        self,
        members: list[Member],
        host: torch.Tensor | None,
        pinned: bool,
        nbytes: int | None = None,
    ) -> None:
        self.members = members
        self.evictable = True
        self.host = host
        self.pinned = pinned
        self.nbytes = host.numel() if host is not None else int(nbytes or 0)
        self.owners: set[str] = set()
        self.arena: Arena | None = None
        self.rebinds = False

    def view(self, buf: torch.Tensor, m: Member) -> torch.Tensor:
        """Member ``m``'s view into ``buf`` (the host span or its device copy)."""
        typed = buf.view(m.dtype)
        return typed.as_strided(m.shape, m.stride, typed.storage_offset() + m.offset)

    def on_device(self, device: torch.device) -> bool:
        """Whether the payload currently lives on ``device`` (judged by the first member)."""
        return same_device(self.members[0].payload.device, device)

    def __repr__(self) -> str:
        m = self.members[0]
        return f"TensorSlot({len(self.members)} tensor(s), {m.shape}, {m.dtype}, {m.payload.device})"


def _extent(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(shape, stride))


def storage_span(payloads: list[torch.Tensor]) -> tuple[int, int] | None:
    """The byte span ``[lo, hi)`` of one storage that host tensors viewing it cover: the
    span one host slot copies (``Mover._adopt_host``), aligned to the largest element size
    and clipped to the storage. None when aliases of several element sizes do not tile it
    (each then gets a slot of its own).

    Args:
        payloads: host tensors (any dtypes, shapes, strides) viewing one storage.
    """
    align = max(p.element_size() for p in payloads)
    lo = min(p.storage_offset() * p.element_size() for p in payloads)
    hi = max(
        (p.storage_offset() + _extent(tuple(p.shape), p.stride())) * p.element_size()
        for p in payloads
    )
    lo -= lo % align
    hi = min(hi + (-hi) % align, payloads[0].untyped_storage().nbytes())
    if len(payloads) > 1 and (hi - lo) % align:
        return None
    return lo, hi


def record_on(stream: Any, members: Iterable["Member"], device: torch.device) -> None:
    """``record_stream(stream)`` on every member payload that lives on ``device``: the
    caching allocator then reuses that memory (allocated on a copy stream) only after the
    work queued on ``stream`` by the time it is freed, whoever frees it. Host-side only:
    no device op, no host wait."""
    with torch.inference_mode(False), torch.no_grad():
        for m in members:
            p = m.payload
            if same_device(p.device, device):
                p.record_stream(stream)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _rebind(obj: torch.Tensor, payload: torch.Tensor) -> None:
    """The move primitive: point ``obj`` at ``payload`` (``obj.data = payload``).

    Identity, Parameter-ness, attributes and ``requires_grad`` of ``obj`` are kept, and it
    works whatever else references ``obj``. Tests replace this function to inject faults
    between tensor moves.
    """
    obj.data = payload


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold SIGINT for the body; raise ``KeyboardInterrupt`` after it if one came."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except ValueError:  # not the main interpreter's main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt("interrupted during a rollback (the rollback completed)")


class Transaction:
    """An undo log: every rebind made through it can be put back, in reverse order.

    ``rollback`` restores each tensor's previous payload and runs the registered undo
    callbacks; objects allocated by the transaction are then unreferenced and freed at
    once. ``commit`` forgets the log (dropping device payloads it kept alive).
    """

    def __init__(self) -> None:
        self._undo: list[tuple[torch.Tensor | None, Any, tuple[torch.Tensor, ...]]] = []

    def rebind(self, obj: torch.Tensor, payload: torch.Tensor, outers: tuple[torch.Tensor, ...] = ()) -> None:
        """``_rebind`` ``obj`` (its DTensor shard, for a DTensor) to ``payload``,
        remembering the current payload; then bring the wrappers ``obj`` is an inner
        tensor of (``outers``, ``Member.outers``) to its device (``quantized.refresh``)."""
        target = payload_of(obj)
        with torch.inference_mode(False), torch.no_grad():
            previous = target.detach()
        self._undo.append((target, previous, outers))
        _rebind(target, payload)
        refresh(outers)

    def on_rollback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (in reverse order with the rebinds) if the transaction rolls back."""
        self._undo.append((None, fn, ()))

    def rollback(self) -> None:
        """Put every rebind back and run the undo callbacks, newest first.

        A Ctrl-C (SIGINT) that arrives during the rollback is held until it has finished,
        then raised as ``KeyboardInterrupt`` (main thread; elsewhere signals do not
        arrive anyway), so a second interrupt cannot leave a half-undone transition.
        """
        with _sigint_deferred(), torch.inference_mode(False), torch.no_grad():
            while self._undo:
                obj, x, outers = self._undo.pop()
                if obj is None:
                    x()
                else:
                    _rebind(obj, x)
                    refresh(outers)

    def commit(self) -> None:
        """Keep every change; drop the log."""
        self._undo.clear()


# ----------------------------------------------------------------------------- the mover


class Mover:
    """Moves slot payloads between host and device; the single move path of the engine.

    Args:
        platform: the device's platform (synchronize, pinning, blocking D2H).
        pin_memory: pin host copies when the platform supports it.
        max_pinned_bytes: host copies are pinned while ``stats.pinned_total_bytes`` (every
            pinned byte so far) stays within this many bytes, the rest pageable; None: no
            cap. Buffers later loads make are counted, not capped (``enable`` leaves room
            for them: ``tiers.check_bytes``).
        arena_bytes: the largest arena ``pack`` makes (``arena.ARENA_BYTES``, 1 GiB).

    Attributes:
        stats: the engine's counters (``TransferStats``).
    """

    def __init__(
        self,
        platform: Platform,
        pin_memory: bool,
        max_pinned_bytes: int | None = None,
        arena_bytes: int = ARENA_BYTES,
    ) -> None:
        self.platform = platform
        self.arena_bytes = arena_bytes
        self.device = platform.device
        self.pin = pin_memory and platform.supports_pinning
        self.max_pinned_bytes = max_pinned_bytes
        self.stats = TransferStats()
        self._pin_warned = False
        self.pins_by_copy = False  # a pin fell back to pin_memory(): a power-of-two block
        self.keep_host = False  # non-evictable slots keep their host copies (``sleep``)
        # the disk tier (``disktier.DiskTier``) when a host budget leaves weights on disk
        self.disk: Any = None

    # -- host copies ------------------------------------------------------------------

    def _may_pin(self, nbytes: int) -> bool:
        cap = self.max_pinned_bytes
        return self.pin and (cap is None or self.stats.pinned_total_bytes + nbytes <= cap)

    def _warn_pin(self, why: str) -> None:
        if not self._pin_warned:
            self._pin_warned = True
            warnings.warn(
                f"pinning host memory failed ({why}); host copies fall back to pageable "
                "memory (slower, synchronous host->device copies)",
                RuntimeWarning,
                stacklevel=5,
            )

    def _account(self, slot: TensorSlot, sign: int) -> None:
        if slot.host is None:
            return
        if self.disk is not None and self.disk.holds(slot):
            self.stats.disk_backed_bytes += sign * slot.nbytes
        elif slot.pinned:
            self.stats.pinned_bytes += sign * slot.nbytes
        else:
            self.stats.pageable_host_bytes += sign * slot.nbytes

    def group(
        self,
        objs: Iterable[torch.Tensor],
        txn: Transaction,
        evictable: bool,
        pack: bool = False,
        outers: dict[int, tuple[torch.Tensor, ...]] | None = None,
    ) -> list[TensorSlot]:
        """Build the slots of ``objs`` (enable or adoption time; never on the eviction path).

        Host tensors that share a storage become one slot whose host copy is the span of
        the original storage they cover. For evictable slots that span is pinned in place
        when allowed (no second copy), and a tensor on the device gets a host copy of its
        own through one D2H copy (counted in ``d2h_bytes``) and stays resident. With
        ``pack`` (``enable``: the tensors of one component) the evictable host copies are
        moved into arenas instead (``pack``), pinned when allowed.
        Non-evictable tensors get no host copy: ``place`` puts them on the device for good.
        ``outers``: id of an inner tensor of a quantized wrapper -> its wrappers
        (``Member.outers``).
        Every tensor must be on the host or on this device (``WeightTable.check_tensors``
        checks that, with the component's and the tensor's names, before anything moves).
        """
        host_groups: dict[int, list[torch.Tensor]] = {}
        slots: list[TensorSlot] = []
        for obj in objs:
            p = payload_of(obj)
            if p.device.type == "cpu":
                host_groups.setdefault(p.untyped_storage().data_ptr() or id(p), []).append(obj)
            elif evictable or self.keep_host:
                slots.append(self._adopt_device(obj, txn))
            else:
                member = Member(obj, p.storage_offset(), p.stride())
                slots.append(TensorSlot([member], None, False, _nbytes(p)))
        pack = pack and (evictable or self.keep_host)  # kept host copies pack too (a wake: one copy an arena)
        for objs_of_storage in host_groups.values():
            pin = (evictable or self.keep_host) and not pack
            slots.extend(self._adopt_host(objs_of_storage, txn, pin=pin))
        for slot in slots:
            slot.evictable = evictable
            if outers:
                for m in slot.members:
                    m.outers = outers.get(id(m.obj), ())
        if self.disk is not None:  # disk-backed host copies stay the file maps (tiers)
            for slot in slots:
                if evictable and not slot.pinned:
                    self._account(slot, -1)
                    self.disk.claim(slot)
                    self._account(slot, +1)
        if pack:
            self.pack([s for s in slots if self.disk is None or not self.disk.holds(s)], txn)
            if self.disk is not None:
                self._pack_disk([s for s in slots if self.disk.holds(s)], txn)
        return slots

    def _pack_disk(self, slots: list[TensorSlot], txn: Transaction) -> None:
        """Group disk-backed ``slots`` into disk arenas (``Arena`` without a host buffer)
        of at most ``arena_bytes`` each, laid out as ``pack`` lays out host arenas: their
        host copies stay their file maps; a load fills one device allocation through the
        staging ring and the write check sums it whole (issue 34)."""
        todo = [
            s for s in slots
            if s.arena is None and s.nbytes > 0 and not any(_is_dtensor(m.obj) for m in s.members)
        ]
        todo.sort(key=self.disk.file_position)  # in file order: read in runs, not per tensor
        for index, offsets, nbytes in layout([s.nbytes for s in todo], self.arena_bytes):
            arena = Arena(None, False, nbytes)
            for i, offset in zip(index, offsets):
                arena.add(todo[i], offset)
                todo[i].arena = arena

            def undo(a: Arena = arena) -> None:
                for slot in list(a.slots):
                    slot.arena = None
                    a.remove(slot)

            txn.on_rollback(undo)

    def pack(self, slots: list[TensorSlot], txn: Transaction) -> list[Arena]:
        """Move the host copies of ``slots`` into arenas of at most ``arena_bytes`` each
        (``arena.layout``: in order, 16-byte aligned), pinned when allowed.

        Each arena is filled slot by slot: a slot's old host copy is dropped as soon as it
        is copied, so the host holds the weights plus one arena at most. Members on the host
        are rebound to their view of the arena (same objects); members on the device stay.
        Slots of DTensor shards, and slots already in an arena, are left as they are. On
        rollback every slot gets a pageable host copy of its own again (equal bytes).

        Returns:
            The arenas made.
        """
        todo = [
            s for s in slots
            if s.host is not None and s.arena is None and s.nbytes > 0
            and not any(_is_dtensor(m.obj) for m in s.members)
        ]
        arenas: list[Arena] = []
        while todo:
            # the first arena of what is left; under max_pinned_bytes it is cut to the room
            # left for pinning, so host copies are pinned up to the cap
            limit = self.arena_bytes
            cap = self.max_pinned_bytes
            room = None if cap is None else cap - self.stats.pinned_total_bytes
            if self.pin and room is not None and 0 < room < limit:
                # pinned by copy, an arena takes a power of two: the largest within the room
                fits = 1 << (room.bit_length() - 1) if self.pins_by_copy else room
                # not even the next slot fits: this arena and the rest are pageable, whole
                limit = fits if fits >= todo[0].nbytes else limit
            index, offsets, nbytes = layout([s.nbytes for s in todo], limit)[0]
            slots_of_arena = [todo[i] for i in index]
            todo = todo[index[-1] + 1 :]
            with torch.inference_mode(False), torch.no_grad():
                # not zeros: pages are touched (and counted) only as each copy fills them
                buf, pinned = self._pin(torch.empty(nbytes, dtype=torch.uint8), [], txn)
                arena = Arena(buf, pinned)
                txn.on_rollback(lambda a=arena: self._unpack(a))
                end = 0
                for slot, offset in zip(slots_of_arena, offsets):
                    buf[end:offset].zero_()  # alignment padding: defined bytes for the sums
                    span = arena.add(slot, offset)
                    span.copy_(slot.host)
                    end = offset + slot.nbytes
                    on_host = not slot.on_device(self.device)
                    self._account(slot, -1)
                    slot.host, slot.pinned, slot.arena = span, pinned, arena
                    self._account(slot, +1)
                    if on_host:
                        for m in slot.members:
                            _rebind(m.obj, slot.view(span, m))
                            refresh(m.outers)
                buf[end:].zero_()
            if pinned:  # the alignment padding is pinned too (freed with the arena's buffer)
                padding = nbytes - sum(s.nbytes for s in slots_of_arena)
                hostmem.charge_while_alive(buf, padding, self.stats.charge_pinned)
            arenas.append(arena)
        return arenas

    def _unpack(self, arena: Arena) -> None:
        """Undo ``pack`` for ``arena``: each slot's host copy becomes a pageable copy of its
        own (members on the host are rebound to it)."""
        with torch.inference_mode(False), torch.no_grad():
            for slot in list(arena.slots):
                old = slot.host
                fresh = old.clone()
                self._account(slot, -1)
                slot.host, slot.pinned, slot.arena = fresh, False, None
                self._account(slot, +1)
                for m in slot.members:
                    if m.payload.device.type == "cpu":
                        _rebind(m.obj, slot.view(fresh, m))
                        refresh(m.outers)
                arena.remove(slot)

    def _pin(self, span: torch.Tensor, objs: list[torch.Tensor], txn: Transaction) -> tuple[torch.Tensor, bool]:
        """Pin the host ``span`` (``uint8``) if allowed: in place, else by one pinned copy.

        Returns the span to use as host copy and whether it is pinned. DTensor shards are
        never pinned. A failure falls back to pageable memory with one warning.
        """
        if (not self._may_pin(span.numel()) or any(_is_dtensor(o) for o in objs)
                or (self.disk is not None and self.disk.wants(objs)) or span.is_pinned()):
            return span, span.is_pinned()
        storage = span.untyped_storage()
        # in place only when the span is the whole storage: registration covers a storage
        # (its pages), and the pinned bytes counted must be the bytes pinned
        if span.numel() == storage.nbytes() and hostmem.pin_in_place(self.platform, storage):
            txn.on_rollback(lambda: hostmem.unpin_in_place(self.platform, storage))
            return span, True
        if span.numel() > hostmem.PIN_CHUNK:  # no single pin above the chunk: a fresh buffer
            fresh = torch.empty(span.numel(), dtype=torch.uint8)  # registered in pieces
            if hostmem.pin_in_place(self.platform, fresh.untyped_storage()):
                fresh.copy_(span)
                return fresh, True
            self._warn_pin(
                f"{span.numel()} bytes exceed the {hostmem.PIN_CHUNK}-byte pinning chunk and "
                "cannot be registered in pieces here"
            )
            return span, False
        self.pins_by_copy = True
        rounded = hostmem.caching_host_bytes(span.numel())  # the caching allocator's block
        if not self._may_pin(rounded):
            return span, False
        try:  # a read-only mapping, or no in-place registration here: copy, per storage
            fresh = span.pin_memory()
        except RuntimeError as exc:
            self._warn_pin(str(exc))
            return span, False
        # the caching host allocator's rounding (the copy's own bytes are the slot's)
        hostmem.charge_while_alive(fresh, rounded - span.numel(), self.stats.charge_pinned)
        return fresh, True

    def _adopt_device(self, obj: torch.Tensor, txn: Transaction) -> TensorSlot:
        p = payload_of(obj)
        member = Member(obj, 0, _contiguous_stride(tuple(p.shape)))
        nbytes = _nbytes(p)
        with torch.inference_mode(False), torch.no_grad():
            host, pinned = self._pin(torch.empty(nbytes, dtype=torch.uint8), [obj], txn)
            slot = TensorSlot([member], host, pinned)
            slot.view(host, member).copy_(p)
        self.stats.d2h_bytes += nbytes
        self._account(slot, +1)
        txn.on_rollback(lambda: self._account(slot, -1))
        return slot

    def _adopt_host(
        self, objs: list[torch.Tensor], txn: Transaction, pin: bool = True
    ) -> list[TensorSlot]:
        payloads = [payload_of(o) for o in objs]
        span = storage_span(payloads)
        if span is None:
            # aliases of several element sizes that do not tile: one slot each
            return [s for o in objs for s in self._adopt_host([o], txn, pin)]
        lo, hi = span
        storage = payloads[0].untyped_storage()
        members = [
            Member(o, (p.storage_offset() * p.element_size() - lo) // p.element_size(), p.stride())
            for o, p in zip(objs, payloads)
        ]
        with torch.inference_mode(False), torch.no_grad():
            span = torch.empty(0, dtype=torch.uint8).set_(storage, lo, (hi - lo,), (1,))
            host, pinned = self._pin(span, objs, txn) if pin else (span, False)
            slot = TensorSlot(members, host, pinned)
            if host is not span:  # pinned by copy: the members move to the pinned copy
                for m in members:
                    txn.rebind(m.obj, slot.view(host, m), m.outers)
        self._account(slot, +1)
        txn.on_rollback(lambda: self._account(slot, -1))
        return [slot]

    def release(self, slot: TensorSlot) -> None:
        """Forget a slot no component holds any more (its gauges; memory goes with it). It
        leaves its arena's slots, so the arena does not keep its tensors alive."""
        self._account(slot, -1)
        if slot.arena is not None:
            slot.arena.slots = [s for s in slot.arena.slots if s is not slot]

    def unrelease(self, slot: TensorSlot) -> None:
        """Undo ``release`` (a rolled-back structural change)."""
        self._account(slot, +1)
        arena = slot.arena
        if arena is not None and all(s is not slot for s in arena.slots):
            arena.slots = sorted([*arena.slots, slot], key=lambda s: arena.offsets[id(s)])

    # -- loads and evictions ----------------------------------------------------------

    def load(self, slot: TensorSlot, txn: Transaction) -> int:
        """Copy the slot's span to the device and rebind its members; return the H2D bytes.

        A member whose host payload was replaced while evicted (``.data = t`` on the host)
        has its new values copied into the host copy first (a host copy, not a transfer).
        """
        if slot.on_device(self.device):
            return 0
        with torch.inference_mode(False), torch.no_grad():
            self._take_host_writes(slot)
            whole = self._whole_view(slot)
            if self.disk is not None and self.disk.holds(slot):  # through the staging ring
                dev = self.disk.to_device(slot, self.device)
                for m in slot.members:
                    txn.rebind(m.obj, slot.view(dev, m), m.outers)
                del dev
            elif whole is not None:  # one tensor covering the span: copy it as itself
                m = slot.members[0]
                txn.rebind(m.obj, whole.to(self.device, non_blocking=slot.pinned), m.outers)
            else:
                dev = slot.host.to(self.device, non_blocking=slot.pinned)
                for m in slot.members:
                    txn.rebind(m.obj, slot.view(dev, m), m.outers)
                del dev
        self.stats.h2d_bytes += slot.nbytes
        return slot.nbytes

    def load_arena(self, arena: Arena, txn: Transaction) -> int:
        """Copy a whole arena to the device in one H2D copy and rebind its slots' members
        to views of that one allocation; return the H2D bytes (the arena's, padding
        included). Every slot of ``arena`` must be off the device. Host-side replacements
        are taken into the host copies first (``load``); a slot that had to leave the arena
        then (a new dtype or shape) is not loaded here."""
        with torch.inference_mode(False), torch.no_grad():
            for slot in list(arena.slots):
                self._take_host_writes(slot)
            if arena.host is None:  # a disk arena: packed through the staging ring
                dev = self.disk.arena_to_device(arena, self.device)
            else:
                dev = arena.host.to(self.device, non_blocking=arena.pinned)
            for slot in arena.slots:
                offset = arena.offsets[id(slot)]
                span = dev[offset : offset + slot.nbytes]
                for m in slot.members:
                    txn.rebind(m.obj, slot.view(span, m), m.outers)
            arena.device_key, arena.checked = self.platform.storage_key(dev), False
            del dev
        txn.on_rollback(arena.unload)
        self.stats.h2d_bytes += arena.nbytes
        return arena.nbytes

    @staticmethod
    def _whole_view(slot: TensorSlot) -> torch.Tensor | None:
        """The host view of a slot's only member when it covers the span contiguously."""
        if len(slot.members) != 1:
            return None
        m = slot.members[0]
        view = slot.view(slot.host, m)
        if m.offset or not view.is_contiguous() or _nbytes(view) != slot.nbytes:
            return None
        return view

    def _take_host_writes(self, slot: TensorSlot) -> None:
        """Copy into the slot's host copy the members replaced on the host while evicted
        (``p.data = t``). A pinned host copy may still be read by an H2D copy queued
        earlier without the host waiting for it (a prefetch, a load whose compute the host
        has not waited for): the device is synchronized before the first such write
        (counted in ``stats.host_write_waits``), so no copy reads half-written bytes.
        Rare by design: only a ``.data`` replacement on the host comes here."""
        settled = not slot.pinned
        for m in slot.members:
            p = m.payload
            view = slot.view(slot.host, m)
            if p.data_ptr() == view.data_ptr() and p.stride() == view.stride():
                continue
            self._note_disk_write(slot)
            if not settled and not (p.dtype != m.dtype or tuple(p.shape) != m.shape):
                self.platform.synchronize()  # no queued copy still reads the pinned bytes
                self.stats.host_write_waits += 1
                settled = True
            if p.dtype != m.dtype or tuple(p.shape) != m.shape:
                if len(slot.members) > 1:
                    raise RuntimeError(
                        f"a tensor aliased with {len(slot.members) - 1} other(s) was given a "
                        f"new dtype/shape {p.dtype}/{tuple(p.shape)} while offloaded; call "
                        "backend.disable() before changing aliased weights"
                    )
                self._rehome(slot, m, p.contiguous() if not p.is_contiguous() else p)
            elif p.untyped_storage().data_ptr() == view.untyped_storage().data_ptr():
                view.copy_(p.clone())  # another view of the same storage: may overlap
            else:
                view.copy_(p)
            if slot.arena is not None:
                slot.arena.host_sums = None

    def _note_disk_write(self, slot: TensorSlot) -> None:
        """A disk-backed host copy is about to be written (``disktier.DiskTier.note_write``)."""
        if self.disk is not None and self.disk.holds(slot):
            self.disk.note_write(slot)

    def _rehome(self, slot: TensorSlot, m: Member, host_value: torch.Tensor) -> None:
        """Make ``host_value`` (a host tensor) the only member's new host copy (pageable);
        the slot leaves its arena."""
        self._account(slot, -1)
        if slot.arena is not None:
            slot.arena.remove(slot)
            slot.arena = None
        flat = host_value.detach().reshape(-1).view(torch.uint8)
        slot.host, slot.pinned, slot.nbytes = flat, False, flat.numel()
        m.dtype, m.shape = host_value.dtype, tuple(host_value.shape)
        m.stride, m.offset = _contiguous_stride(m.shape), 0
        self._account(slot, +1)

    def evict(self, slots: list[TensorSlot], txn: Transaction, changed: list[bool]) -> int:
        """Rebind every member of ``slots`` (resident, evictable) to its host copy.

        Members whose bytes changed while resident are written back first. Returns the
        D2H bytes written. Write-backs are synchronized before this returns when they were
        asynchronous. The slots' arenas are no longer loaded whole.

        Args:
            changed: per member (the slots' members in order), whether its device bytes
                differ from its host copy (``ComponentWeights.changed``; with layer
                mode's ``check_writes=False``, whether it was replaced). A member whose
                dtype or shape changed is always written back.
        """
        members = [(s, m) for s in slots for m in s.members]
        if not members:
            return 0
        written = 0
        for (slot, m), differs in zip(members, changed):
            if differs:
                self._note_disk_write(slot)  # before any write: refused, nothing changes
        with torch.inference_mode(False), torch.no_grad():
            for (slot, m), differs in zip(members, changed):
                p = m.payload
                same_layout = p.dtype == m.dtype and tuple(p.shape) == m.shape
                if same_layout and not differs:
                    continue  # unchanged: no copy
                if same_layout:
                    slot.view(slot.host, m).copy_(
                        p, non_blocking=slot.pinned and not self.platform.blocking_d2h
                    )
                    if slot.arena is not None:
                        slot.arena.host_sums = None
                elif len(slot.members) == 1:
                    self._rehome(slot, m, p.to("cpu"))
                else:
                    raise RuntimeError(
                        f"a tensor aliased with {len(slot.members) - 1} other(s) was given a "
                        f"new dtype/shape {p.dtype}/{tuple(p.shape)} while resident; call "
                        "backend.disable() before changing aliased weights"
                    )
                written += _nbytes(p)
            if written and not self.platform.blocking_d2h and any(s.pinned for s in slots):
                self.platform.synchronize()
            for slot, m in members:
                txn.rebind(m.obj, slot.view(slot.host, m), m.outers)
        for arena in {id(s.arena): s.arena for s in slots if s.arena is not None}.values():
            loaded = (arena.device_key, arena.checked)
            arena.unload()
            txn.on_rollback(lambda a=arena, v=loaded: _restore(a, v))
        self.stats.d2h_bytes += written
        return written

    def place(self, slot: TensorSlot, txn: Transaction) -> int:
        """Put a non-evictable slot on the device and drop its host copy (kept with
        ``keep_host``: a ``sleep`` moves it back). Returns the H2D bytes (0: there)."""
        moved = 0 if slot.host is None else self.load(slot, txn)
        if slot.host is not None and not self.keep_host:
            host, pinned = slot.host, slot.pinned
            self._account(slot, -1)
            slot.host, slot.pinned = None, False

            def undo() -> None:
                slot.host, slot.pinned = host, pinned
                self._account(slot, +1)

            txn.on_rollback(undo)
        return moved
