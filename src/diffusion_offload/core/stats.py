"""The engine's counters: ``TransferStats``, what the mover moved and what the host holds.

Every backend keeps one (``backend.stats``), shared by its mover, its write checks, its
layer-mode streamer and its host tiers; ``snapshot``/``since`` give the counts of one
request, and ``as_dict`` the report's ``offload_stats``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["TransferStats"]


@dataclass
class TransferStats:
    """The engine's own counters of the weight moves it made, and its host memory.

    Attributes:
        h2d_bytes: weight bytes copied host->device.
        d2h_bytes: weight bytes copied device->host: write-backs of tensors whose bytes
            changed while resident, and host copies of tensors adopted while on the device.
            Fingerprint read-backs are not weight bytes and are not counted here.
        loads: component loads that moved at least one tensor.
        evictions: component evictions that moved at least one tensor.
        transfer_seconds: wall seconds spent in loads and evictions, synchronize included.
        fingerprint_bytes: device bytes read by write checks (``checks.LoadCheck``: at
            load and when leaving the device).
        fingerprints: write-check sums computed on the device: one per arena (its
            weighted byte sums, ``checksum``) or per member fingerprinted one by one, at
            load and when leaving.
        check_d2h_bytes: bytes copied back to the host to decide whether weights changed:
            an arena's sums (4 bytes each) and 8 per member compared with its host copy.
            Not weight bytes.
        check_h2d_bytes: bytes of the checks' weights copied to the device
            (``checksum.weights_bytes``: 8 per byte of the widest grid row, once per check:
            an arena's record and compare, per-member device fingerprints, a disk tier's
            record). Not weight bytes.
        device_checks: write checks decided on the device when weights left it: one
            comparison read back (a host wait) each, plus per-member read-backs when it
            differs.
        host_write_waits: device synchronizes before a host write into a pinned host
            copy (a member replaced by ``.data = t`` while evicted, taken into its host
            copy at the next load: ``Mover._take_host_writes``).
        prefetches: layer mode: block loads issued ahead of use on the copy stream.
        fallback_loads: layer mode: blocks that ran without having been prefetched (the
            model skipped or repeated a block, or the first block of a first call) and
            were loaded synchronously.
        wasted_prefetches: layer mode: prefetched blocks released without having run (a
            wrong guess, or a block a cache such as First Block Cache skipped: at most one
            per cached forward).
        wasted_bytes: the H2D bytes of those blocks (part of ``h2d_bytes``).
        pinned_bytes: bytes of host copies in pinned (page-locked) memory now (a gauge;
            with ``pageable_host_bytes`` and ``disk_backed_bytes``, where the host copies
            are: SPEC section 3). Every pinned byte held for this backend is
            ``pinned_total_bytes``.
        pinned_overhead_bytes: the pinned host memory held for this backend beyond the
            host copies' own bytes (a gauge): the staging ring, the write check's host
            buffers (the sums read back at a load, the disk tier's fingerprints, the
            checksum weights), the alignment
            padding of pinned arenas, and the caching host allocator's rounding where a
            buffer had to come from ``pin_memory()`` (``hostmem.caching_host_bytes``).
            Counted while the memory is alive: a buffer freed is taken out.
        shared_pinned_bytes: of ``pinned_overhead_bytes``, the process's one pinned copy of
            the checksum weights (``checksum.pinned_weights_bytes``), shared by every
            backend: each counts it whole (a gauge).
        pageable_host_bytes: bytes of host copies in pageable memory now (a gauge).
        disk_backed_bytes: bytes of host copies left on disk: file-backed memory maps read
            at every load (``tiers``; a gauge).
        disk_read_bytes: bytes read from disk-backed host copies (the loads' reads).
        disk_read_seconds: seconds the loads spent reading them into the staging ring
            (``os.preadv`` from the files, or copies from their memory maps).
        cow_bytes: bytes of disk-backed host copies written (private copy-on-write pages:
            anonymous memory, counted against the host budget; a gauge).
        staging_bytes: bytes of the pinned staging ring of disk-backed loads (a gauge).
        staging_copies: H2D copies from the staging ring (one per staging chunk of a
            load, ``staging.StagingRing.copy``).
        staging_waits: host waits of the staging ring: one per reuse of a buffer (the
            event of the copy last queued from it).
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    loads: int = 0
    evictions: int = 0
    transfer_seconds: float = 0.0
    fingerprint_bytes: int = 0
    fingerprints: int = 0
    check_d2h_bytes: int = 0
    check_h2d_bytes: int = 0
    device_checks: int = 0
    host_write_waits: int = 0
    prefetches: int = 0
    fallback_loads: int = 0
    wasted_prefetches: int = 0
    wasted_bytes: int = 0
    pinned_bytes: int = 0
    pinned_overhead_bytes: int = 0
    shared_pinned_bytes: int = 0
    pageable_host_bytes: int = 0
    disk_backed_bytes: int = 0
    disk_read_bytes: int = 0
    disk_read_seconds: float = 0.0
    cow_bytes: int = 0
    staging_bytes: int = 0
    staging_copies: int = 0
    staging_waits: int = 0

    _GAUGES = ("pinned_bytes", "pinned_overhead_bytes", "shared_pinned_bytes",
               "pageable_host_bytes", "disk_backed_bytes", "cow_bytes", "staging_bytes")

    def charge_pinned(self, nbytes: int) -> None:
        """Count ``nbytes`` more pinned host memory that is not a host copy's own bytes
        (negative: that much freed) in ``pinned_overhead_bytes`` (``hostmem.host_buffer``'s
        ``charge``)."""
        self.pinned_overhead_bytes += nbytes

    @property
    def pinned_total_bytes(self) -> int:
        """Every byte of pinned host memory held for this backend now: the pinned host
        copies (``pinned_bytes``) plus ``pinned_overhead_bytes`` (issue 34 item 4: what a
        host's page-locked memory, and ``max_pinned_bytes``, must hold)."""
        return self.pinned_bytes + self.pinned_overhead_bytes

    def snapshot(self) -> "TransferStats":
        """A copy of the current values."""
        return TransferStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def since(self, earlier: "TransferStats") -> "TransferStats":
        """Counters accumulated after ``earlier`` (a ``snapshot``); gauges keep their current value."""
        return TransferStats(
            **{
                f.name: getattr(self, f.name)
                if f.name in self._GAUGES
                else getattr(self, f.name) - getattr(earlier, f.name)
                for f in fields(self)
            }
        )

    def as_dict(self) -> dict[str, float]:
        """The counters as a plain dict (JSON-ready), with ``pinned_total_bytes``."""
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["pinned_total_bytes"] = self.pinned_total_bytes
        return out
