"""Device write checks: which resident members differ from their host copies when they
leave the device.

Right after an arena is loaded whole, ``record`` computes the weighted byte sums of its
device bytes (``checksum.weighted_sums``: one or two integer matrix products, however
many tensors it holds; a missed change has probability at most ``2**-64``) and copies
them to a pinned host buffer without waiting (``Arena.loaded_sums``): nothing is kept on
the device, so device memory is exactly the tensors' arenas. When the members leave,
``changed`` computes the same sums again and reads them back: one copy, one host wait,
compared on the host. An arena never recorded (layer mode's carried block) is compared
with the sums of its host copy instead (``Arena.host_sums``, computed on the host once
and again after a write into it).

Everything else is compared with its host copy (``compare_with_host``): the device
fingerprints of the payloads (``writes.fingerprints``, 8 bytes each read back) against
the same fingerprints of their host copies, computed on the host (exact integer
arithmetic: equal bytes give equal values on any device). That is the path of members of
an arena whose sums differ, of members no longer covered by their arena (their ``.data``
was reassigned, as diffusers' layerwise casting does on every forward), of slots outside
any arena, and of arenas whose sums could not be recorded. Every write path that changes
the bytes is seen: in-place ops, ``.data`` in-place ops, ``.data`` reassignment to new
bytes; equal bytes are never written back (README, write detection).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import checksum, hostmem
from .arena import Arena
from .platform import Platform
from .stats import TransferStats
from .transfer import Member, TensorSlot
from .writes import fingerprints

__all__ = ["changed", "compare_with_host", "record"]


def record(
    stats: TransferStats,
    items: Sequence[tuple[Arena, torch.Tensor]],
    platform: Platform,
    buf: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy the sums of the device bytes of each arena of ``items`` (``(arena, payload)``:
    any member tensor viewing its allocation) to ``Arena.loaded_sums`` without waiting:
    one or two integer matrix products an arena, one copy of the checksum weights to the
    device and one asynchronous device->host copy of all the sums, on the current stream
    (the comparison that reads them later runs after it); the arenas are then
    ``checked``. Called right after the load, so for a disk arena (no host buffer) these
    sums are its ``host_sums`` too.

    Args:
        buf: the host ``int32`` buffer a previous call returned for the same arenas, reused
            when its size fits (no new pinned allocation a load).

    Returns:
        The host buffer (pinned when possible) the sums are copied into; each arena's
        ``loaded_sums`` is its view of it.

    Raises:
        torch.OutOfMemoryError: no device room for the sums (about 16 * sqrt(words) bytes
            an arena).
    """
    words = sum(a.sum_words for a, _ in items)
    with torch.inference_mode(False), torch.no_grad():
        if buf is None or buf.numel() != words:  # pageable where it cannot pin: a synchronous copy
            buf = hostmem.host_buffer(words, torch.int32, platform, True, stats.charge_pinned)
        now = torch.empty(words, dtype=torch.int32, device=platform.device)
        w = device_weights(stats, platform, max(a.shape[1] for a, _ in items))
        start = 0
        for arena, payload in items:
            end = start + arena.sum_words
            checksum.weighted_sums(arena.allocation(payload), arena.shape, now[start:end], w)
            arena.loaded_sums = buf[start:end]
            start = end
        buf.copy_(now, non_blocking=True)
    for arena, _ in items:
        if arena.on_disk:  # right after a load: the device bytes are the files' bytes
            arena.host_sums = arena.loaded_sums
        arena.checked = True
        stats.fingerprint_bytes += arena.nbytes
    stats.fingerprints += len(items)
    stats.check_d2h_bytes += 4 * words
    return buf


def device_weights(stats: TransferStats, platform: Platform, width: int) -> torch.Tensor:
    """``checksum.device_weights`` for a check of grid ``width`` bytes, counted in
    ``stats.check_h2d_bytes``; an empty tensor for ``width == 0`` (small arenas are read
    back as they are: no weights)."""
    if width == 0:
        return torch.empty((0, checksum.COLUMNS), dtype=torch.int8, device=platform.device)
    stats.check_h2d_bytes += width * checksum.COLUMNS
    w = checksum.device_weights(platform.device, width)
    checksum.count_pinned(stats)
    return w


Recorded = Callable[[TensorSlot], "torch.Tensor | None"]
"""``slot`` -> the fingerprints of its members' host copies recorded when it was loaded
(host ``int64``, one per member; ``disktier.DiskTier.recorded``), or None when none were."""


def compare_with_host(
    stats: TransferStats, pairs: list[tuple[TensorSlot, Member]], recorded: Recorded | None = None
) -> list[bool]:
    """Per ``(slot, member)``, whether the member's device payload differs from its host
    copy: fingerprints of both (the device's read back in one copy of 8 bytes a member,
    the host's computed on the host, or the ones ``recorded`` at the load: a host copy
    left on disk is not read again). A member whose dtype or shape changed differs.

    Raises:
        torch.OutOfMemoryError: no device room for the fingerprints' temporaries.
    """
    if not pairs:
        return []
    same_layout = [m.payload.dtype == m.dtype and tuple(m.payload.shape) == m.shape for _, m in pairs]
    comparable = [p for p, ok in zip(pairs, same_layout) if ok]
    device: list[int] = []
    host: list[int] = []
    if comparable:
        with torch.inference_mode(False), torch.no_grad():
            device = fingerprints([m.payload for _, m in comparable]).tolist()
            known = _recorded(comparable, recorded)
            todo = [p for p, k in zip(comparable, known) if k is None]
            computed = iter(fingerprints([s.view(s.host, m) for s, m in todo]).tolist())
            host = [next(computed) if k is None else k for k in known]
    stats.check_h2d_bytes += checksum.weights_bytes(m.nbytes for _, m in comparable)  # the device fingerprints'
    checksum.count_pinned(stats)
    stats.fingerprints += len(comparable)
    stats.fingerprint_bytes += sum(m.nbytes for _, m in comparable)
    stats.check_d2h_bytes += 8 * len(comparable)
    differs = iter([d != h for d, h in zip(device, host)])
    return [next(differs) if ok else True for ok in same_layout]


def _recorded(pairs: list[tuple[TensorSlot, Member]], recorded: Recorded | None) -> list[int | None]:
    """Per pair, its member's fingerprint recorded at the load, or None."""
    if recorded is None:
        return [None] * len(pairs)
    by_member: dict[int, int | None] = {}  # id(member) -> its recorded fingerprint
    for slot, _ in pairs:
        if id(slot.members[0]) not in by_member:
            fps = recorded(slot)
            values = [None] * len(slot.members) if fps is None else fps.tolist()
            by_member.update(zip(map(id, slot.members), values))
    return [by_member[id(m)] for _, m in pairs]


def changed(
    stats: TransferStats,
    pairs: list[tuple[TensorSlot, Member]],
    platform: Platform,
    recorded: Recorded | None = None,
) -> list[bool]:
    """Per ``(slot, member)`` (resident, about to leave), whether its device bytes differ
    from its host copy.

    The arenas loaded whole whose members are all still covered (``Arena.covers``) are
    checked by their sums: two reductions each, one copy of all of them to the host (the
    one host wait), compared there with ``Arena.loaded_sums`` (recorded at the load) or,
    for an arena not recorded, ``Arena.host_sums``. The members of an arena whose sums
    differ, and every member not covered that way, are compared with their host copies
    (``compare_with_host``, with the fingerprints ``recorded`` at their loads where there
    are some). A slot with a member whose ``.data`` was reassigned is
    marked (``TensorSlot.rebinds``): its arena loads tensor by tensor from then on.

    Raises:
        torch.OutOfMemoryError: no device room for the comparison's temporaries.
    """
    arenas: dict[int, Arena] = {}
    whole: dict[int, bool] = {}
    payload_of_arena: dict[int, torch.Tensor] = {}
    for slot, m in pairs:
        a = slot.arena
        if a is None or a.device_key is None:
            continue
        p = m.payload
        if a.covers(p, platform.storage_key(p), slot, m):
            arenas[id(a)] = a
            whole.setdefault(id(a), True)
            payload_of_arena.setdefault(id(a), p)
        else:
            whole[id(a)] = False
            slot.rebinds = True
    # a disk arena with neither this load's sums nor host sums: compared member by member
    live = [
        a for key, a in arenas.items()
        if whole[key] and (a.checked or not a.on_disk or a.host_sums is not None)
    ]
    live_ids = {id(a) for a in live}
    suspect = [k for k, (slot, _) in enumerate(pairs) if id(slot.arena) not in live_ids]
    if live:
        with torch.inference_mode(False), torch.no_grad():
            now = torch.empty(sum(a.sum_words for a in live), dtype=torch.int32, device=platform.device)
            w = device_weights(stats, platform, max(a.shape[1] for a in live))
            start = 0
            for a in live:
                checksum.weighted_sums(
                    a.allocation(payload_of_arena[id(a)]), a.shape, now[start : start + a.sum_words], w
                )
                start += a.sum_words
            now_host = now.cpu()  # the one host wait (after any recorded copy on this stream)
            stats.fingerprints += len(live)
            stats.fingerprint_bytes += sum(a.nbytes for a in live)
            stats.check_d2h_bytes += 4 * now.numel()
            bad: set[int] = set()
            start = 0
            for a in live:
                part = now_host[start : start + a.sum_words]
                start += a.sum_words
                ref = a.loaded_sums if a.checked and a.loaded_sums is not None else a.reference_on_host()
                if torch.equal(part, ref):
                    continue
                bad.add(id(a))
                # the host copy may have been written while on the host: what the device
                # holds is compared tensor by tensor below, then remembered as the reference
                a.host_sums = None
            suspect += [k for k, (slot, _) in enumerate(pairs) if id(slot.arena) in bad]
    order = sorted(suspect)
    verdict = dict(zip(order, compare_with_host(stats, [pairs[k] for k in order], recorded)))
    return [verdict.get(k, False) for k in range(len(pairs))]
