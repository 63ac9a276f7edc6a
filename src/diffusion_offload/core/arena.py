"""Host arenas: many host copies in one buffer, loaded with one H2D copy, checked with two
reductions.

An ``Arena`` is one flat ``uint8`` host buffer (pinned when allowed) that holds the host
copies of several slots (``transfer.TensorSlot``) back to back, each at an offset aligned
to ``ALIGN`` bytes. A component's (module mode) or a streamed block's (layer mode) slots
are packed into arenas of at most ``ARENA_BYTES`` each when the backend is enabled
(``transfer.Mover.pack``), so a load is one H2D copy per arena and its device tensors are
views of one allocation, freed together, instead of one copy and one allocation per
tensor. A slot larger than ``ARENA_BYTES`` gets an arena of its own.

The write check of a loaded arena hashes its device bytes with weighted byte sums
(``checksum.weighted_sums``: one integer matrix product, two with a cover of the last
bytes, whatever the number of tensors in it) and copies the sums (``32`` bytes per grid
row of about ``2 * sqrt(bytes)`` bytes) back to the host. Any change that does not depend
on the process's random weights is missed with probability at most ``2**-64``
(``checksum``: permutations, swaps and sign flips included); the sums are exact integer
arithmetic, so host and device compute equal values.

Sources: CUDA's caching allocator hands out 512-byte aligned blocks and vectorized kernels
want 16-byte aligned operands (PyTorch's CUDA loops vectorize up to 16 bytes), hence
``ALIGN``; ``ARENA_BYTES`` is issue 18's chunk bound (pinning one buffer of 12 GiB or more
fails on some drivers: vllm-omni #2748).
"""

from __future__ import annotations

from typing import Any

import torch

from . import checksum

__all__ = ["ALIGN", "ARENA_BYTES", "Arena", "device_bytes", "layout"]

ALIGN = 16
"""Byte alignment of every host copy inside an arena (and of the arena's end)."""

ARENA_BYTES = 1 << 30
"""Largest arena, in bytes (1 GiB), unless one slot alone is larger."""


def _round_up(n: int, to: int) -> int:
    return n + (-n) % to


def layout(sizes: list[int], limit: int = ARENA_BYTES) -> list[tuple[list[int], list[int], int]]:
    """Split slots of ``sizes`` bytes (in order) into arenas of at most ``limit`` bytes.

    Returns one ``(indices, offsets, nbytes)`` per arena: the slots' indices into
    ``sizes``, their byte offsets (multiples of ``ALIGN``) and the arena's size (a
    multiple of ``ALIGN``). Zero-byte slots are left out (nothing to copy). Order is kept,
    so tensors used together stay together.
    """
    out: list[tuple[list[int], list[int], int]] = []
    idx: list[int] = []
    offs: list[int] = []
    end = 0
    for i, n in enumerate(sizes):
        if n <= 0:
            continue
        start = _round_up(end, ALIGN)
        if idx and start + n > limit:
            out.append((idx, offs, _round_up(end, ALIGN)))
            idx, offs, start = [], [], 0
        idx.append(i)
        offs.append(start)
        end = start + n
    if idx:
        out.append((idx, offs, _round_up(end, ALIGN)))
    return out


def device_bytes(sizes: list[int], limit: int = ARENA_BYTES) -> int:
    """Device bytes that loading the arenas of host copies of ``sizes`` bytes allocates:
    each arena, its alignment padding included; what the planner predicts for an
    offloaded component."""
    return sum(n for _, _, n in layout(sizes, limit))


class Arena:
    """One host buffer holding several slots' host copies, and what its loads need.

    A load copies ``host`` into one device allocation of ``nbytes``; the write check
    keeps nothing on the device: its reference sums live on the host (``loaded_sums``,
    copied back asynchronously right after the load; ``host_sums``, computed on the host).

    A disk arena (``host`` None, ``on_disk``) groups disk-backed slots (``tiers``): their
    host copies stay their own file maps, and a load packs them into the one device
    allocation through the staging ring (``disktier.DiskTier.arena_to_device``, padding
    zeroed). It has no buffer to sum on the host: the sums recorded on the device right
    after a load (``checks.record``) are its host sums too (the device bytes then equal
    the files'), until a write into a host copy drops them; without any, its members are
    compared one by one (``checks``).

    Args:
        host: the buffer, or None for a disk arena.
        pinned: whether ``host`` is pinned.
        nbytes: a disk arena's size in bytes (``host``'s size otherwise).

    Attributes:
        host: the flat ``uint8`` host buffer (``nbytes``), pinned when ``pinned``; the
            slots' ``host`` are views of it. None for a disk arena.
        slots: the slots whose host copies live in it (``transfer.TensorSlot``), in
            offset order; a slot whose host copy had to move elsewhere (a new dtype or
            shape) leaves, its bytes stay as padding.
        offsets: ``id(slot)`` -> the slot's byte offset in ``host``.
        nbytes: the buffer's size in bytes (a multiple of ``ALIGN``).
        shape: the layout the write check reads it as (``checksum.shape``).
        device_key: while the arena is loaded whole, ``Platform.storage_key`` of its
            device allocation (not a reference: the allocation lives as long as the
            tensors that view it); None otherwise.
        checked: ``loaded_sums`` holds the sums of this load's device bytes (``checks.record``).
        loaded_sums: host ``int32`` buffer (pinned when possible) the device's sums are
            copied into, without a host wait, after each load.
        host_sums: the sums of ``host`` computed on the host, or None until needed (and
            after a write into ``host``).
    """

    __slots__ = (
        "host", "slots", "offsets", "pinned", "nbytes", "shape", "device_key", "checked",
        "loaded_sums", "host_sums",
    )

    def __init__(self, host: torch.Tensor | None, pinned: bool, nbytes: int | None = None) -> None:
        self.host = host
        self.pinned = pinned
        self.nbytes = host.numel() if host is not None else int(nbytes or 0)
        self.slots: list[Any] = []
        self.offsets: dict[int, int] = {}
        self.shape = checksum.shape(self.nbytes)
        self.device_key: int | None = None
        self.checked = False
        self.loaded_sums: torch.Tensor | None = None
        self.host_sums: torch.Tensor | None = None

    @property
    def on_disk(self) -> bool:
        """A disk arena: no host buffer, its slots' host copies are file maps."""
        return self.host is None

    @property
    def sum_words(self) -> int:
        """``int32`` elements of the arena's check sums (``checksum.size``)."""
        return checksum.size(self.shape, self.nbytes)

    def add(self, slot: Any, offset: int) -> torch.Tensor:
        """Place ``slot`` at ``offset``; return its span of ``host`` (a disk arena: the
        slot's own host copy)."""
        self.slots.append(slot)
        self.offsets[id(slot)] = offset
        if self.host is None:
            return slot.host
        return self.host[offset : offset + slot.nbytes]

    def remove(self, slot: Any) -> None:
        """``slot``'s host copy left the arena (its bytes stay, as padding)."""
        self.slots = [s for s in self.slots if s is not slot]
        self.offsets.pop(id(slot), None)

    def unload(self) -> None:
        """The arena is no longer loaded whole."""
        self.device_key, self.checked = None, False

    def covers(self, payload: torch.Tensor, key: int, slot: Any, member: Any) -> bool:
        """Whether ``payload`` (the device tensor of ``member`` of ``slot``; ``key``: its
        ``Platform.storage_key``) is still the member's view of this arena's device
        allocation: the arena's check then covers its bytes. Host-side only."""
        if self.device_key is None or key != self.device_key or id(slot) not in self.offsets:
            return False
        return (
            payload.dtype == member.dtype
            and tuple(payload.shape) == member.shape
            and payload.stride() == member.stride
            and payload.storage_offset() * payload.element_size()
            == self.offsets[id(slot)] + member.offset * payload.element_size()
        )

    def allocation(self, payload: torch.Tensor) -> torch.Tensor:
        """The whole device allocation (``nbytes``, ``uint8``) that ``payload``, a covered
        member's tensor, views."""
        first = torch.as_strided(payload.detach(), (1,), (1,), 0).view(torch.uint8)
        return torch.as_strided(first, (self.nbytes,), (1,), 0)

    def reference_on_host(self) -> torch.Tensor:
        """``host_sums``, computed on the host now if not known (a pass over the arena).

        Raises:
            ValueError: a disk arena (no host buffer to sum).
        """
        if self.host is None:
            if self.host_sums is None:
                raise ValueError("a disk arena has no host buffer: only its recorded sums compare")
            return self.host_sums
        if self.host_sums is None:
            out = torch.empty(self.sum_words, dtype=torch.int32)
            checksum.weighted_sums(self.host, self.shape, out, checksum.weights(self.shape[1]))
            self.host_sums = out
        return self.host_sums

    def __repr__(self) -> str:
        return f"Arena({len(self.slots)} slot(s), {self.nbytes} bytes, pinned={self.pinned})"
