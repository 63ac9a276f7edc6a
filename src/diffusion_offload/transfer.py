"""Weight residency: one authoritative host copy per tensor, and the moves between them.

``TensorSlot`` is one unique parameter or buffer (tied tensors share one slot).
``ComponentWeights`` is the group of slots of one pipeline component and owns its loads
and evictions; ``Mover`` performs every move on every platform the same way and keeps
the engine's own counters (``TransferStats``).

The rules (SPEC section 4):

* Tensors move one by one, never through a recursive ``module.to()``. The module keeps
  the same Python object for each parameter and buffer: the payload is exchanged with
  ``torch.utils.swap_tensors`` (``p.data = t`` fails across CPU and PrivateUse1 tensors,
  and between wrapper subclasses keeps old values), so Parameter identity holds, tied
  tensors stay tied and compiled graphs keep their guards.
* Each evictable tensor has exactly one host copy, made (and pinned, when asked and
  supported) once at enable time. Loading copies host->device; evicting an unmodified
  tensor drops the device copy and points the tensor back at the host copy, with no
  device->host copy. A tensor changed while resident (in-place op: ``_version`` moved;
  ``.data`` reassigned: storage no longer ``is_set_to`` the loaded copy) is copied back.
* Moves run with inference mode off and autograd off, so host and device copies are
  ordinary tensors even when the caller is inside ``torch.inference_mode()``.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, fields

import torch
from torch import nn

from .platform import Platform, same_device

__all__ = [
    "ComponentWeights",
    "Mover",
    "TensorSlot",
    "TransferStats",
    "Undo",
    "collect_tensors",
]


@dataclass
class TransferStats:
    """The engine's own counters of the weight moves it made.

    Attributes:
        h2d_bytes: weight bytes copied host->device.
        d2h_bytes: weight bytes copied device->host (write-backs of modified tensors).
        loads: component loads that moved at least one tensor.
        evictions: component evictions that moved at least one tensor.
        transfer_seconds: wall seconds spent in loads and evictions, synchronize included.
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    loads: int = 0
    evictions: int = 0
    transfer_seconds: float = 0.0

    def snapshot(self) -> "TransferStats":
        """A copy of the current values."""
        return TransferStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def since(self, earlier: "TransferStats") -> "TransferStats":
        """The counts accumulated after ``earlier`` (a ``snapshot``) was taken."""
        return TransferStats(
            **{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}
        )

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict (JSON-ready)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed
        return False
    return isinstance(t, DTensor)


def collect_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every distinct parameter and buffer object of ``module`` and its submodules.

    Persistent and non-persistent buffers are included; a tensor registered in several
    places (tied weights) appears once. Order: ``named_modules`` order, parameters before
    buffers.
    """
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for sub in module.modules():
        for store in (sub._parameters, sub._buffers):
            for t in store.values():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out


class TensorSlot:
    """One parameter or buffer object and, if it may be evicted, its host copy.

    Attributes:
        live: the tensor object the modules hold; its identity never changes.
        evictable: False when the tensor is shared with a component that must stay
            resident; such a slot has no host copy and never leaves the device.
        host: the authoritative host copy (pinned when ``pinned``), or None.
        nbytes: payload size in bytes.
    """

    __slots__ = ("live", "evictable", "host", "pinned", "nbytes", "_alias", "_version")

    def __init__(self, live: torch.Tensor, evictable: bool) -> None:
        self.live = live
        self.evictable = evictable
        self.host: torch.Tensor | None = None
        self.pinned = False
        self.nbytes = _nbytes(self.tensor)  # a DTensor's local shard, not the global size
        self._alias: torch.Tensor | None = None  # the device copy as loaded
        self._version = 0

    @property
    def tensor(self) -> torch.Tensor:
        """The tensor whose payload moves: the DTensor's local shard, or ``live``."""
        return self.live._local_tensor if _is_dtensor(self.live) else self.live

    def on_device(self, device: torch.device) -> bool:
        """Whether the payload currently lives on ``device``."""
        return same_device(self.tensor.device, device)

    def __repr__(self) -> str:
        return f"TensorSlot({tuple(self.live.shape)}, {self.live.dtype}, {self.tensor.device})"


def _replacement(target: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """A fresh tensor object of ``target``'s kind (Parameter or not) holding ``payload``."""
    if isinstance(target, nn.Parameter):
        return nn.Parameter(payload, requires_grad=target.requires_grad)
    return payload.detach()


Undo = list[tuple[TensorSlot, torch.Tensor]]
"""Displaced payloads recorded at enable time: swap each back, in reverse, to roll back."""


class Mover:
    """Moves slot payloads between host and device; the single move path of the engine.

    Args:
        platform: the device's platform (synchronize, pinning, blocking D2H).
        pin_memory: pin host copies when the platform supports it.

    Attributes:
        stats: the engine's counters (``TransferStats``).
    """

    def __init__(self, platform: Platform, pin_memory: bool) -> None:
        self.platform = platform
        self.device = platform.device
        self.pin = pin_memory and platform.supports_pinning
        self.stats = TransferStats()
        self._pin_warned = False

    # -- primitive moves --------------------------------------------------------------

    def _swap(self, slot: TensorSlot, payload: torch.Tensor, undo: Undo | None) -> None:
        """Point ``slot``'s tensor at ``payload``.

        The object left holding the old payload is appended to ``undo`` (enable time, so
        a failure can swap it back) or dropped, which frees a device payload.
        """
        target = slot.tensor
        other = _replacement(target, payload)
        torch.utils.swap_tensors(target, other)
        if undo is not None:
            undo.append((slot, other))

    def _pinned(self, host: torch.Tensor) -> torch.Tensor | None:
        """A pinned copy of ``host``, or None (pinning off, a DTensor shard, or it failed)."""
        if not self.pin:
            return None
        try:
            return host.pin_memory()
        except RuntimeError as exc:
            if not self._pin_warned:
                self._pin_warned = True
                warnings.warn(
                    f"pinning host memory failed ({exc}); host copies fall back to pageable "
                    "memory (slower, synchronous host->device copies)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return None

    def adopt(self, slot: TensorSlot, undo: Undo | None = None) -> None:
        """Give an evictable slot its host copy (enable time; never on the eviction path).

        A payload on the host becomes the host copy itself, or is replaced by its pinned
        copy. A payload on the device gets a host copy through one D2H copy (counted) and
        the slot stays resident.
        """
        t = slot.tensor
        with torch.inference_mode(False), torch.no_grad():
            on_device = slot.on_device(self.device)
            host = t.to("cpu") if on_device else t.detach()
            pinned = None if _is_dtensor(slot.live) else self._pinned(host)
            slot.host = pinned if pinned is not None else host
            slot.pinned = pinned is not None
            if on_device:
                slot._alias = t.detach()
                slot._version = t._version
                self.stats.d2h_bytes += slot.nbytes
            elif pinned is not None:
                self._swap(slot, pinned, undo)

    def load(self, slot: TensorSlot, undo: Undo | None = None) -> int:
        """Copy the slot to the device if it is not there; return the H2D bytes."""
        if slot.on_device(self.device):
            return 0
        t = slot.tensor
        if slot.host is not None and not t.is_set_to(slot.host):
            # ``.data`` was reassigned on the host while evicted: that payload is the copy now
            slot.host, slot.pinned = t.detach(), False
            slot.nbytes = _nbytes(t)
        src = slot.host if slot.host is not None else t
        with torch.inference_mode(False), torch.no_grad():
            dev = src.to(self.device, non_blocking=slot.pinned)
            self._swap(slot, dev, undo)
            slot._alias = dev
            slot._version = slot.tensor._version
        self.stats.h2d_bytes += slot.nbytes
        return slot.nbytes

    def evict(self, slot: TensorSlot, undo: Undo | None = None) -> int:
        """Point an evictable slot back at its host copy; return the D2H bytes (0 if unmodified)."""
        if not slot.evictable or not slot.on_device(self.device):
            return 0
        t = slot.tensor
        written = 0
        with torch.inference_mode(False), torch.no_grad():
            modified = (
                slot._alias is None
                or t._version != slot._version
                or not t.is_set_to(slot._alias)
            )
            if modified:
                host = slot.host
                if host is not None and host.shape == t.shape and host.dtype == t.dtype:
                    host.copy_(t, non_blocking=slot.pinned and not self.platform.blocking_d2h)
                else:  # reshaped or retyped through ``.data``: a new, pageable host copy
                    slot.host, slot.pinned = t.to("cpu"), False
                written = _nbytes(t)
                slot.nbytes = written
            self._swap(slot, slot.host, undo)
            slot._alias = None
        self.stats.d2h_bytes += written
        return written

    def place(self, slot: TensorSlot, undo: Undo | None = None) -> int:
        """Move a non-evictable slot to the device for good (enable time); return H2D bytes."""
        if slot.on_device(self.device):
            return 0
        with torch.inference_mode(False), torch.no_grad():
            self._swap(slot, slot.tensor.to(self.device), undo)
        self.stats.h2d_bytes += slot.nbytes
        return slot.nbytes


class ComponentWeights:
    """The tensors of one pipeline component and their residency (loads and evictions).

    Args:
        name: the component's name (e.g. ``"transformer"``), for messages and traces.
        role: ``"dit"``, ``"text_encoder"``, ``"encoder"``, ``"vae"`` or ``"resident"``.
        selected: True if the config selects this component for offload.
        slots: the component's slots (shared slots appear in every owner).
        mover: the backend's ``Mover``.

    Attributes:
        resident: True while the component's evictable tensors are on the device.
        nbytes: bytes of all the component's tensors (shared ones included).
    """

    def __init__(
        self, name: str, role: str, selected: bool, slots: list[TensorSlot], mover: Mover
    ) -> None:
        self.name = name
        self.role = role
        self.selected = selected
        self.slots = slots
        self.mover = mover
        self.resident = not selected
        self.nbytes = sum(s.nbytes for s in slots)
        self.listeners: list = []  # callables (event, component, seconds) for traces

    @property
    def evictable_bytes(self) -> int:
        """Bytes that leave the device when this component is evicted."""
        return sum(s.nbytes for s in self.slots if s.evictable)

    def _notify(self, event: str, seconds: float) -> None:
        for listener in self.listeners:
            listener(event, self, seconds)

    def load(self) -> int:
        """Copy every tensor of the component to the device; return H2D bytes.

        A selected component that is already resident returns 0 at once.
        Raises ``torch.OutOfMemoryError`` from the device with the component named; the
        tensors loaded before the failure are evicted again (free: they are unmodified),
        so a failed load leaves nothing of the component on the device.
        """
        if self.resident:
            return 0
        start = time.perf_counter()
        loaded: list[TensorSlot] = []
        moved = 0
        try:
            for slot in self.slots:
                n = self.mover.load(slot)
                if n:
                    loaded.append(slot)
                    moved += n
        except torch.OutOfMemoryError as exc:
            for slot in loaded:
                self.mover.evict(slot)
            raise torch.OutOfMemoryError(
                f"out of device memory while loading component {self.name!r} "
                f"({self.nbytes} bytes): {exc}"
            ) from exc
        if moved:
            self.mover.platform.synchronize()
        seconds = time.perf_counter() - start
        self.resident = True
        if moved:
            self.mover.stats.loads += 1
            self.mover.stats.transfer_seconds += seconds
            self._notify("load", seconds)
        return moved

    def evict(self) -> int:
        """Point every evictable tensor back at its host copy; return the tensors moved.

        Unselected components never evict; tensors shared with resident components stay.
        Unmodified tensors cost no copy; write-backs of modified ones are synchronized
        before this returns.
        """
        if not self.selected or not self.resident:
            return 0
        start = time.perf_counter()
        on_device = [s for s in self.slots if s.evictable and s.on_device(self.mover.device)]
        written = sum(self.mover.evict(s) for s in on_device)
        if written:  # asynchronous write-backs must land before the host copy is read
            self.mover.platform.synchronize()
        seconds = time.perf_counter() - start
        self.resident = False
        if on_device:
            self.mover.stats.evictions += 1
            self.mover.stats.transfer_seconds += seconds
            self._notify("evict", seconds)
        return len(on_device)

    def __repr__(self) -> str:
        state = "resident" if self.resident else "host"
        return f"ComponentWeights({self.name!r}, role={self.role!r}, {state})"
