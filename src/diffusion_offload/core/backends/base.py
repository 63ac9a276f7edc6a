"""``OffloadBackendBase``: what every backend shares (SPEC section 4).

The backends (``module.py``: model-level offload; ``layer.py``: layer mode) build on it:
config and device checks, component discovery, host-copy adoption and pinning, the
hook table, ``disable``, ``audit`` and the delegation to a pipeline that offloads itself
(``split.py``). ``enable`` is one
transaction: it validates everything first (selection, shared modules, meta tensors,
host memory), and if any move or hook install fails, for any exception, it removes the
hooks it installed and puts every tensor back where it was. ``audit`` lists every breach
of the residency invariant.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import disktier, hostmem, tiers
from ..weights_from import back_with_files
from ..config import DiffusionOffloadConfig, parse_diffusion_offload_config
from ..discovery import Component, discover_components
from ..foreign import check_foreign_hooks
from ..hooks import HookHandle, get_handle
from ..platform import Platform, platform_for, same_device
from ..residency import ComponentWeights, WeightTable, named_carriers
from ..stats import TransferStats
from ..transfer import Mover, Transaction, payload_of
from .execution_device import follow_offload
from .split import SupportsModelCpuOffload

__all__ = ["OffloadBackendBase"]

logger = logging.getLogger(__name__)


class OffloadBackendBase:
    """What every offload backend shares: config, device, mover, lifecycle.

    ``enable`` / ``disable`` / ``is_enabled`` / context-manager use / ``stats`` /
    ``modules`` behave the same in every mode; a mode implements ``_enable`` (validate,
    establish the placement and install hooks, all in one transaction) and ``audit``.
    Subclasses set ``MODE``.

    Args:
        config: a ``DiffusionOffloadConfig`` or a mapping/JSON accepted by
            ``parse_diffusion_offload_config`` (``mode`` must be the subclass's ``MODE``).
        device: the accelerator (``"cuda"``, ``"cuda:1"``, ``"fakegpu"``...). On ``cpu``
            offload is a documented no-op: ``enable`` installs nothing.
        component_roles: role overrides for discovery (name -> role).
        use_hsdp: passed to split models (``SupportsModelCpuOffload``).
        max_pinned_bytes: pin at most this many bytes of host copies; the rest stay in
            pageable memory (``stats.pinned_bytes`` / ``stats.pageable_host_bytes`` say
            which). None: no cap.
        host_memory_budget: bytes of host memory the host copies may take (pinned and
            pageable copies, the staging ring, written disk-backed pages), ``"auto"``
            (``tiers.auto_host_budget``, measured at ``enable``) or None (no budget: every
            host copy in RAM, as before). What does not fit stays on disk, file-backed
            (``tiers``); ``stats`` gives ``pinned_bytes``, ``pageable_host_bytes``,
            ``disk_backed_bytes`` and ``disk_read_bytes``; ``tier_plan`` the choice.
        weights_from: with a ``host_memory_budget``, the pipeline folder the weights came
            from, for a pipeline not loaded by ``Omni``: at ``enable`` its selected host
            weights that are not file-backed are file-backed from that folder's safetensors
            (``weights_from.back_with_files``: matched by name, shape, dtype and bytes; a
            mismatch raises ``WeightsMismatchError`` naming the tensor); without it, such
            weights are RAM-only and count against the budget.
        page_cache: with a ``host_memory_budget`` that leaves weights on disk, what
            happens to the file pages a load read (``hostmem.PAGE_CACHE``): ``"drop"``
            (``POSIX_FADV_DONTNEED`` after the copy, so they do not pile up in a cgroup's
            memory, which counts page cache), ``"keep"``, or ``"auto"`` (the default:
            drop when a cgroup memory limit applies, ``tiers.cgroup_limited``). The start
            line says which is in force.
        sleepable: keep a host copy of every tensor, those that rest on the device too
            (unselected components, VAEs, trunks: pinned in place, counted in the host
            gauges and the host budget), so ``sleep`` can empty the device with no
            device-to-host copy of an unmodified weight (several models sharing one
            device, ``engine.pool``).

    A backend is a context manager: ``with ModelLevelOffloadBackend(...) as b:
    b.enable(pipe)`` disables on exit.

    Raises:
        TypeError, ValueError: an invalid config, device or ``max_pinned_bytes``; a
            config whose ``mode`` belongs to the other backend (named).
    """

    MODE = ""
    #: size a staging-ring buffer to the largest selected component's disk-backed bytes
    #: (layer mode: a streamed block, so the reader reads the next one ahead); otherwise to
    #: the largest tensor (module mode: a whole component would take the budget)
    STAGE_BY_UNIT = False

    def __init__(
        self,
        config: DiffusionOffloadConfig | Mapping[str, Any] | str,
        device: str | torch.device | int,
        *,
        component_roles: Mapping[str, str] | None = None,
        use_hsdp: bool = False,
        max_pinned_bytes: int | None = None,
        host_memory_budget: int | str | None = None,
        weights_from: str | os.PathLike[str] | None = None,
        page_cache: str = "auto",
        sleepable: bool = False,
    ) -> None:
        parsed = parse_diffusion_offload_config(config)
        if parsed is None:
            raise ValueError("config must not be None; pass a diffusion_offload_config")
        if parsed.mode != self.MODE:
            other = "LayerwiseOffloadBackend" if parsed.mode == "layer" else "ModelLevelOffloadBackend"
            raise ValueError(
                f"mode={parsed.mode!r} is run by {other}; {type(self).__name__} implements "
                f"mode={self.MODE!r}"
            )
        if max_pinned_bytes is not None and (
            isinstance(max_pinned_bytes, bool) or not isinstance(max_pinned_bytes, int)
        ):
            raise TypeError(
                f"max_pinned_bytes must be an int number of bytes or None, got {max_pinned_bytes!r}"
            )
        if max_pinned_bytes is not None and max_pinned_bytes < 0:
            raise ValueError(f"max_pinned_bytes must be >= 0 bytes, got {max_pinned_bytes}")
        self.config = parsed
        self.platform: Platform = platform_for(device)
        self.device = self.platform.device
        self.component_roles = dict(component_roles) if component_roles else None
        self.use_hsdp = use_hsdp
        self.max_pinned_bytes = max_pinned_bytes
        self.host_memory_budget = tiers.check_budget(host_memory_budget)
        self.page_cache = hostmem.check_page_cache(page_cache)
        if weights_from is not None and not isinstance(weights_from, (str, os.PathLike)):
            raise TypeError(f"weights_from must be a folder path (str or PathLike) or None, got {weights_from!r}")
        self.weights_from = weights_from
        #: the host tiers chosen at the last ``enable`` with a budget (``tiers.TierPlan``)
        self.tier_plan: tiers.TierPlan | None = None
        self.mover = Mover(self.platform, parsed.pin_memory, max_pinned_bytes)
        self.mover.keep_host = bool(sleepable)
        #: every tensor is on the host after ``sleep`` until ``wake``
        self.asleep = False
        self.components: dict[str, ComponentWeights] = {}
        self._table: WeightTable | None = None
        self.lock = threading.RLock()
        self._handles: list[HookHandle] = []
        self._delegate: SupportsModelCpuOffload | None = None
        self._pipeline_ref: Any = None
        self._enabled = False

    # ------------------------------------------------------------------ public API

    @property
    def modules(self) -> dict[str, torch.nn.Module]:
        """The managed component modules that are still alive, by name (held weakly)."""
        live = {n: c.module_ref() for n, c in self.components.items()}
        return {n: m for n, m in live.items() if m is not None}

    @property
    def stats(self) -> TransferStats:
        """The engine's counters of weight moves (bytes, loads, evictions, seconds) and
        its host memory (``pinned_bytes``, ``pageable_host_bytes``)."""
        return self.mover.stats

    def is_enabled(self) -> bool:
        """Whether ``enable`` has completed and ``disable`` has not."""
        return self._enabled

    def __enter__(self) -> "OffloadBackendBase":
        """``with ModelLevelOffloadBackend(...) as backend:``: the backend itself."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Disable on leaving the ``with`` block (also when it raised)."""
        self.disable()

    def enable(self, pipeline: Any) -> None:
        """Install model-level offload on ``pipeline`` (idempotent for the same pipeline).

        Afterwards the selected DiTs are on the host and everything else on the device;
        each DiT, encoder and VAE module carries one ``SequentialOffloadHook``.

        Raises:
            ValueError: the selection cannot be honoured (no DiT, no encoder stage, or
                ``text_encoder`` selected but none found); a component holds a meta
                tensor or a tensor on another device; this backend is already enabled on
                another pipeline; module mode: ``device_memory_budget`` (``"auto"``
                resolved) is below the smallest workable budget (a
                ``policy.BudgetTooSmallError`` naming it in bytes and the value given).
                Nothing was changed.
            RuntimeError: a component module is already managed by another backend;
                nothing was changed.
            foreign.ForeignHookError (a ValueError): a component carries accelerate's
                ``_hf_hook`` or diffusers' group-offload hooks (named, with how to
                remove them); nothing was changed.
            MemoryError: the host cannot hold the host copies (bytes needed and
                available named); nothing was changed. ``tiers.HostBudgetError`` (a
                MemoryError): the weights that cannot be file-backed exceed
                ``host_memory_budget`` (both named, in bytes); nothing was changed.
            TypeError: the pipeline's components cannot be discovered.
            torch.OutOfMemoryError: the device cannot hold what must be resident; every
                hook and tensor was rolled back.
        """
        with self.lock:
            if self._enabled and self._pipeline_ref is not None and self._pipeline() is None:
                self.disable()  # its pipeline was deleted: start afresh
            if self._enabled:
                if self._is_current(pipeline):
                    return
                raise ValueError(
                    f"this backend is already enabled on another pipeline "
                    f"({type(self._pipeline()).__name__}); call disable() first, or use one "
                    "backend per pipeline"
                )
            if isinstance(pipeline, SupportsModelCpuOffload):
                self._enable_delegated(pipeline)
                self._remember(pipeline)
                return
            components = discover_components(pipeline, self.component_roles)
            self._check_selection(components)
            if self.platform.is_noop:
                logger.info("device is cpu: model-level offload is a no-op (nothing to offload to)")
                self._enabled = True
                self._remember(pipeline)
                return
            self._check_unmanaged(components)
            check_foreign_hooks(components, pipeline)
            # a diffusers pipeline (and every sub-pipeline sharing its modules) computes on
            # the offload device even when all its modules rest on the host
            follow_offload(pipeline)
            self._enable(components)
            self._remember(pipeline)

    def sleep(self) -> int:
        """Move every tensor of the pipeline to its host copy: the selected components are
        evicted, the streamed blocks released, and what rests on the device (unselected
        components, VAEs, trunks) goes back to its kept host copy; a weight written on the
        device is written back first (``d2h_bytes``), an unmodified one costs no copy. The
        device then holds none of the pipeline's weights; ``wake`` (or the next load of a
        component) brings them back. Between requests only. Idempotent.

        Returns:
            The weight bytes that left the device.

        Raises:
            RuntimeError: not enabled, not built ``sleepable``, or a forward is running.
        """
        with self.lock:
            if not self._enabled or not self.mover.keep_host:
                raise RuntimeError(f"sleep() needs an enabled backend built with sleepable=True ({self!r})")
            before = self.device_weight_bytes()
            self._release_streamed()
            for w in self.components.values():
                if w.selected:
                    w.evict()
            resting: dict[int, tuple[ComponentWeights, Any]] = {}
            for w in self.components.values():
                for s in w.slots:
                    if not s.evictable and s.host is not None and s.on_device(self.device):
                        resting.setdefault(id(s), (w, s))
            txn = Transaction()
            try:
                for w in {id(w): w for w, _ in resting.values()}.values():
                    slots = [s for owner, s in resting.values() if owner is w]
                    self.mover.evict(slots, txn, w.changed(slots))
            except BaseException:
                txn.rollback()
                raise
            txn.commit()
            self.platform.synchronize()
            self.asleep = True
            return before - self.device_weight_bytes()

    def wake(self) -> int:
        """Undo ``sleep``: put back on the device what rests there after ``enable`` (the
        selected components load at their next call, as always). Returns the H2D bytes;
        0 when not asleep."""
        with self.lock:
            if not self.asleep:
                return 0
            moved = sum(w.load() for w in self.components.values() if not self._at_rest_on_host(w))
            self.asleep = False
            return moved

    def _release_streamed(self) -> None:
        """``sleep``'s first step: release whatever the mode streams (layer mode's blocks)."""

    def device_weight_bytes(self) -> int:
        """Bytes of the managed tensors on the device now (each slot once)."""
        slots = {id(s): s for w in self.components.values() for s in w.slots}
        return sum(s.nbytes for s in slots.values() if s.on_device(self.device))

    def disable(self) -> None:
        """Remove every hook this backend installed; tensors stay where they are. The host
        copies leave the host gauges of ``stats`` (``pinned_bytes`` then keeps only our
        pinned buffers still alive: ``pinned_overhead_bytes``).

        All or nothing: if a removal raises (any exception, ``KeyboardInterrupt``
        included), the hooks already removed are installed again, the backend stays
        enabled and working, and calling ``disable`` again does the whole job.

        Raises:
            BaseException: whatever a hook removal raised.
        """
        with self.lock:
            if not self._enabled:
                return
            if self._delegate is not None:
                self._delegate.disable_omni_model_cpu_offload()
                self._delegate = None
            removed: list[HookHandle] = []
            current = None
            try:
                for handle in reversed(self._handles):
                    current = handle
                    handle.remove()
                    removed.append(handle)
                current = None
            except BaseException:
                # a removal that raised may have finished (or got past the point where
                # its handle stopped working) before raising: put it back too (every
                # handle kind says whether it is installed in ``active``)
                if current is not None and not current.active:
                    current.reinstall()
                for handle in reversed(removed):
                    handle.reinstall()
                raise
            self._handles = []
            # the host copies are the pipeline's own tensors now: out of the host gauges
            # (pinned, pageable, disk-backed), so a later enable counts them once
            slots = {id(s): s for w in self.components.values() for s in w.slots}
            for slot in slots.values():
                self.mover.release(slot)
            if self.mover.disk is not None:
                self.mover.disk.close()
            self.components = {}
            self._table = None
            self._pipeline_ref = None
            self._enabled = False

    # ------------------------------------------------------------------ internals

    def _remember(self, pipeline: Any) -> None:
        try:
            self._pipeline_ref = weakref.ref(pipeline)
        except TypeError:  # not weak-referenceable: compare by identity
            self._pipeline_ref = lambda p=pipeline: p

    def _pipeline(self) -> Any:
        return self._pipeline_ref() if self._pipeline_ref is not None else None

    def _is_current(self, pipeline: Any) -> bool:
        return self._pipeline() is pipeline

    def _check_unmanaged(self, components: list[Component]) -> None:
        for comp in components:
            for sub in comp.module.modules():
                if get_handle(sub) is not None:
                    raise RuntimeError(
                        f"component {comp.name!r} ({type(comp.module).__name__}) already has an "
                        "offload hook of another backend (one offload hook per module); "
                        "disable that backend first"
                    )

    def _check_host_memory(
        self, named: dict[str, list[tuple[str, torch.Tensor]]], selected: dict[str, bool]
    ) -> int | None:
        """Refuse before anything moves when the host cannot hold the new host copies;
        return the cap on pinned bytes for this ``enable``: ``max_pinned_bytes``, lowered
        to the bytes pinned already plus the host memory available now
        (``hostmem.available_host_bytes``) when the host cannot lock every host copy (as
        mmgp's partial pinning does: page-locked memory cannot be reclaimed; the rest
        stays pageable, with one warning), less the room the buffers of later loads pin
        (``tiers.check_bytes``), so that ``stats.pinned_total_bytes`` stays within it.
        None: no cap."""
        needed = 0
        pinnable = 0
        seen: set[int] = set()
        sizes: dict[str, list[int]] = {}
        for name, tensors in named.items():
            if not selected[name]:
                continue
            for _, t in tensors:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                p = payload_of(t)
                n = p.numel() * p.element_size()
                sizes.setdefault(name, []).append(n)
                pinnable += n
                if p.device.type != "cpu":
                    needed += n
        available = hostmem.available_host_bytes()
        if needed and available is not None and needed > available:
            raise MemoryError(
                f"enable() needs {needed} bytes of host memory for host copies of the "
                f"selected components' weights now on {self.device}, but only {available} "
                "bytes are available; free host memory, or select fewer components"
            )
        limit = hostmem.locked_memory_limit()
        cap = self.max_pinned_bytes
        want = pinnable if cap is None else min(pinnable, cap)
        # every pinned byte stays within what is available: the buffers later loads pin
        # (write-check sums, padding, checksum weights) get their room first
        reserve = tiers.check_bytes(sizes.values())
        room = None if available is None else max(
            self.mover.stats.pinned_total_bytes + available - reserve, 0)
        if self.mover.pin and room is not None and want > room:
            warnings.warn(
                f"pinning at most {room} of the {want} bytes of host copies: the host has "
                f"{available} bytes available (MemAvailable), {reserve} of them kept for the "
                "copies' pinned buffers; the rest stays in pageable memory (synchronous "
                "host->device copies)",
                RuntimeWarning,
                stacklevel=4,
            )
            cap = want = room
        if self.mover.pin and self.platform.locks_host_memory and limit is not None and want > limit:
            warnings.warn(
                f"pinning up to {want} bytes of host copies, above this process's locked-memory "
                f"limit (RLIMIT_MEMLOCK, {limit} bytes); where the driver enforces it, the rest "
                "falls back to pageable memory. Raise it with `ulimit -l` or set max_pinned_bytes",
                RuntimeWarning,
                stacklevel=4,
            )
        return cap

    def _plan_tiers(
        self, named: dict[str, list[tuple[str, torch.Tensor]]], selected: dict[str, bool]
    ) -> disktier.DiskTier | None:
        """Choose the host tiers under ``host_memory_budget`` (``tiers.plan_tiers``), log
        the one start line, and return the disk tier when weights stay on disk (None: no
        budget, or everything fits in RAM, as without one).

        Raises:
            tiers.HostBudgetError: what cannot be file-backed exceeds the budget.
        """
        self.tier_plan = None
        budget = self.host_memory_budget
        if budget is None:
            return None
        payloads: dict[int, torch.Tensor] = {}
        for name, tensors in named.items():
            if selected[name]:
                for _, t in tensors:
                    p = payload_of(t)
                    if p.device.type == "cpu":
                        payloads.setdefault(id(t), t)
        # on the device now: their first eviction allocates their host copies (RAM only)
        on_device = self._bytes_on_device({n: ts for n, ts in named.items() if selected[n]})
        if self.mover.keep_host:  # sleepable: what rests on the device keeps a copy in RAM
            resting = {id(t): payload_of(t) for n, ts in named.items() if not selected[n]
                       for _, t in ts if id(t) not in payloads}
            on_device += sum(p.numel() * p.element_size() for p in resting.values())
        maps = tiers.FileMaps()
        if self.weights_from is not None:
            if back_with_files(self.weights_from, named, selected, maps):
                maps = tiers.FileMaps()  # the new maps
        if budget == "auto":
            held = sum(
                payload_of(t).numel() * payload_of(t).element_size()
                for t in payloads.values() if maps.backing(payload_of(t)) is None
            )
            budget = tiers.auto_host_budget(held)
        unit = 0 if not self.STAGE_BY_UNIT else tiers.stage_unit(
            [(payload_of(t).numel() * payload_of(t).element_size(),
              maps.backing(payload_of(t)) is not None) for _, t in tensors]
            for name, tensors in named.items() if selected[name]
        )
        # the write checks' pinned buffers and the arenas' padding, per packing unit
        overhead = tiers.check_bytes(
            [payload_of(t).numel() * payload_of(t).element_size() for _, t in tensors if id(t) in payloads]
            for name, tensors in named.items() if selected[name]
        )
        plan = tiers.plan_tiers(payloads.values(), budget, maps, unit, on_device, overhead)
        self.tier_plan = plan
        if not plan.disk_bytes:
            logger.info(plan.line())
            return None
        drop = self.page_cache == "drop" or (self.page_cache == "auto" and tiers.cgroup_limited())
        why = f"page_cache={self.page_cache!r}"
        if self.page_cache == "auto":
            why += ": a cgroup memory limit applies" if drop else ": no cgroup memory limit"
        logger.info("%s; the file pages a load reads are %s (%s)", plan.line(),
                    "dropped after its copy" if drop else "kept in the page cache", why)
        return disktier.DiskTier(plan, self.platform, self.mover.stats, self.mover.pin, maps=maps, drop_pages=drop)

    def _placement_breaches(self) -> list[str]:
        """Per tensor of every component: managed, and on the side its slot and its
        owners' ``resident`` flags say (the per-tensor part of ``audit``, both modes): a
        slot that is not evictable on the device; an evictable one on the device exactly
        while at least one of its owners is resident (a tensor tied between two selected
        components follows whichever of them is resident). An inner tensor of a quantized
        wrapper subclass must be on the device its wrapper reports.

        A tensor that is not managed is reported unless a pending structural change
        explains it and it holds no device memory of an evicted component. Call with the
        lock held, while enabled.
        """
        out: list[str] = []
        table = self._table
        assert table is not None
        comps = self.components
        for comp in comps.values():
            pending = comp.generation != comp.synced
            module = comp.module_ref()
            carried = [] if module is None else named_carriers(module, comp.skip, comp.name)
            for c in carried:
                tname, t = c.name, c.tensor
                slot = table.slot_of(t)
                where = payload_of(t).device
                on_dev = same_device(where, self.device)
                stale = [o for o in c.outers if o.device != where]
                if stale:
                    out.append(
                        f"{comp.name}: tensor {tname!r} is on {where} but the "
                        f"{type(stale[0]).__name__} it belongs to says {stale[0].device}"
                    )
                if slot is None or comp.name not in slot.owners:
                    # a pending change is adopted at the next activation, but a new
                    # tensor of an evicted component must not hold device memory
                    if not pending or (on_dev and comp.selected and not comp.resident):
                        out.append(f"{comp.name}: tensor {tname!r} is not managed by the backend (on {where})")
                    continue
                # a tensor shared by several components (a tie between two selected
                # ones) is on the device while any of its owners is resident
                holders = sorted(o for o in slot.owners if o in comps and comps[o].resident)
                want_dev = not self.asleep and ((not slot.evictable) or bool(holders))
                if on_dev != want_dev:
                    shared = f", shared with {sorted(slot.owners - {comp.name})}" if len(slot.owners) > 1 else ""
                    out.append(
                        f"{comp.name}: tensor {tname!r} is on {where} but should be on "
                        f"{'the device' if want_dev else 'the host'} "
                        f"(resident={comp.resident}, evictable={slot.evictable}{shared})"
                    )
        return out

    def _at_rest_on_host(self, weights: ComponentWeights) -> bool:
        """Whether ``weights`` rest on the host after ``enable`` (per mode)."""
        raise NotImplementedError

    def _establish(self, weights: dict[str, ComponentWeights], txn: Transaction) -> None:
        """Put what rests on the host there and everything else on the device, evicting
        before loading.

        Each eviction and load commits at once, so an evicted component's device copy is
        freed before anything is loaded; if a later step fails, the enable transaction
        puts every evictable tensor back on the side it was on.
        """
        device = self.device
        unique = {id(s): s for w in weights.values() for s in w.slots if s.evictable}
        original = [(slot, slot.on_device(device)) for slot in unique.values()]
        txn.on_rollback(lambda: self._restore(original))
        for w in weights.values():
            if self._at_rest_on_host(w):
                w.resident = True
                w.evict()
        for w in weights.values():
            if not self._at_rest_on_host(w):
                if w.selected and any(
                    s.evictable and s.arena is not None and s.arena.device_key is None and s.on_device(device)
                    for s in w.slots
                ):
                    # on the device in allocations of its own (placed there before enable):
                    # moved into its arenas' allocations, one H2D copy each, so what is
                    # resident is what the budget and the write checks account for
                    w.resident = True
                    w.evict()
                w.load()
        self.platform.synchronize()

    def _restore(self, original: list[tuple[Any, bool]]) -> None:
        """Put evictable slots back on the side they were on (a rolled-back ``enable``)."""
        mover = self.mover
        for slot, was_on_device in original:
            now = slot.on_device(self.device)
            if was_on_device and not now:
                mover.load(slot, Transaction())
            elif now and not was_on_device:
                mover.evict([slot], Transaction())

    def _enable(self, components: list[Component]) -> None:
        """Validate, place and hook ``components`` in one transaction (per mode)."""
        raise NotImplementedError

    def _check_selection(self, components: list[Component]) -> None:
        """Refuse a selection the pipeline cannot honour, before anything moves."""
        raise NotImplementedError

    def _bytes_on_device(self, named: dict[str, list[tuple[str, torch.Tensor]]]) -> int:
        """Bytes of the distinct tensors in ``named`` that are on this backend's device now
        (what a ``device_memory_budget`` of ``"auto"`` counts as available: they are what
        the budget is for)."""
        seen: dict[int, int] = {}
        for tensors in named.values():
            for _, t in tensors:
                p = payload_of(t)
                if id(t) not in seen and same_device(p.device, self.device):
                    seen[id(t)] = p.numel() * p.element_size()
        return sum(seen.values())

    def _transact_enable(
        self,
        table: WeightTable,
        named: dict[str, list[tuple[str, torch.Tensor]]],
        selected: dict[str, bool],
        install: Callable[[dict[str, ComponentWeights], list[Any]], None],
    ) -> None:
        """The transaction every mode's ``enable`` runs: check the tensors and the host
        memory, adopt the tensors, put each on its resting side, ``install`` the hooks
        (appending each installed handle to the list it gets); on any exception remove
        those handles and roll every move back."""
        table.check_tensors(named)
        pin_cap = self._check_host_memory(named, selected)
        disk = self._plan_tiers(named, selected)
        weights = table.components
        txn = Transaction()
        handles: list[Any] = []
        self.mover.disk = disk
        try:
            self.mover.max_pinned_bytes = pin_cap
            try:
                table.adopt(named, txn, pack=True)
            finally:
                self.mover.max_pinned_bytes = self.max_pinned_bytes
            for w in weights.values():
                w._register_modules()
            self._establish(weights, txn)
            install(weights, handles)
        except BaseException:
            for handle in reversed(handles):
                handle.remove()
            txn.rollback()
            if disk is not None:
                disk.close()
            self.mover.disk = None
            self.mover.stats.staging_bytes = 0
            raise
        txn.commit()
        self.components = weights
        self._table = table
        self._handles = handles
        self._enabled = True

    def _enable_delegated(self, pipeline: SupportsModelCpuOffload) -> None:
        raise ValueError(
            f"{type(pipeline).__name__} manages its own offload (SupportsModelCpuOffload), "
            f"which implements mode='module' only; {type(self).__name__} cannot run it"
        )
