"""``LayerwiseOffloadBackend``: layer mode, block-streamed components (SPEC section 10).

Each selected component (DiT, text encoder) keeps its *trunk* on the device (embeddings,
norms, heads: everything outside its blocks) and streams its blocks: block i+1 is copied
host->device on a dedicated copy stream while block i computes, so at most two streamed
blocks sit on the device at any moment, across all components: the one that runs and the
one being prefetched. Unselected components stay resident. There is no mutual exclusion
between components: each streams its own blocks.

Ordering, on platforms with streams (CUDA, XPU, NPU, the fake device):

* a block's load (its H2D copies and the device fingerprints of its bytes) is queued on
  the copy stream and followed by an event; before the block runs, the compute stream
  waits on that event (never a device-wide synchronize);
* when a block has run, the compute stream records an event, the copy stream waits on it,
  and only then are the block's device copies dropped: the caching allocator may hand
  that memory to the next prefetch, which the copy stream orders after the compute that
  read it;
* a load is copies only. A release fingerprints the block's tensors on the device, folds
  them into one 64-bit word and reads back those 8 bytes, to compare with the same fold
  of the host copies' fingerprints (computed on the host, once per block, and updated at
  every write-back; the fingerprint is exact integer arithmetic, equal on any device).
  Only when they differ are the per-tensor fingerprints read back, and the tensors that
  changed written back, as module mode does (section 4). The check holds no device
  memory between load and release.

Other platforms copy synchronously on the current stream.

The order of the blocks comes from their containers (``blocks.discover_blocks``). A block
that runs without having been prefetched (the model skipped or repeated one) is loaded
synchronously and counted in ``stats.fallback_loads``; a wrongly prefetched block is
dropped. After a component's last block, the first streamed block of the component that
ran next last time (or of the same component) is prefetched; a component's forward
prefetches its own first streamed block when nothing is prefetched yet.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .backend import OffloadBackendBase
from .blocks import check_disjoint, discover_blocks
from .config import DiffusionOffloadConfig
from .discovery import Component
from .hooks import SequentialOffloadHook, attach_hook
from .platform import Platform
from .residency import ComponentWeights, WeightTable
from .transfer import Member, Mover, Transaction, fingerprints

__all__ = ["BlockStreamer", "LayerwiseOffloadBackend"]

logger = logging.getLogger(__name__)

_STREAMED_ROLES = ("dit", "text_encoder")
_STAGE_ROLES = ("dit", "text_encoder", "encoder", "vae")


class _Block:
    """One streamed block: its weights, its place in its component, its device state."""

    __slots__ = ("component", "index", "name", "weights", "event", "ref", "members", "on_device", "__weakref__")

    def __init__(self, component: str, index: int, name: str, weights: ComponentWeights) -> None:
        self.component = component
        self.index = index
        self.name = name
        self.weights = weights
        self.event: Any = None  # recorded on the copy stream after the load
        self.ref: list[int] | None = None  # fingerprints of the host copies, per member
        self.members: list[Member] = []  # the members ``ref`` covers, in order
        self.on_device = False

    @property
    def nbytes(self) -> int:
        """Bytes that stream for this block."""
        return self.weights.evictable_bytes

    def __repr__(self) -> str:
        return f"_Block({self.component}.{self.name}, {'device' if self.on_device else 'host'})"


class BlockStreamer:
    """Moves streamed blocks for one backend: at most two on the device, prefetch ahead.

    Args:
        platform: the device's platform (streams, events).
        mover: the backend's mover (its ``stats`` count prefetches and fallbacks).
        lock: the backend's lock (activations from several threads are serialized).
        prefetch: copy the next block ahead of use (on the copy stream where the
            platform has streams). False: every block loads when it runs (for
            measurements; results are the same).
        check_writes: compare each released block with its host copy (8 bytes read
            back) and write changed weights back. False trusts that nothing writes the
            weights while they are on the device (pure inference): no read-back, no
            host wait per block, and a write to a streamed weight is lost.

    Attributes:
        sequences: component name -> its streamed blocks in execution order.
        running: the block whose forward is running, or None.
        prefetched: the block being (or already) copied ahead of use, or None.
        successor: ``(component, n)`` -> the component whose forward followed the n-th
            consecutive forward of ``component``, as last observed: the prediction for the
            prefetch after a component's last block. Keyed by the run length, so "the
            text encoder runs twice (prompt, negative prompt), then the DiT 2 x steps times
            (guidance), then the next request's text encoder" is predicted exactly from
            the previous request.
    """

    def __init__(
        self, platform: Platform, mover: Mover, lock: Any, prefetch: bool = True, check_writes: bool = True
    ) -> None:
        self.platform = platform
        self.check_writes = check_writes
        self.stats = mover.stats
        self.device = platform.device
        self.lock = lock
        self.prefetch = prefetch
        self.copy_stream = platform.new_stream()
        self.sequences: dict[str, list[_Block]] = {}
        self.running: _Block | None = None
        self.prefetched: _Block | None = None
        self.successor: dict[tuple[str, int], str] = {}
        self._call: tuple[str, int] | None = None  # the forward running now, and its run length
        self.max_on_device = 0  # high-water mark of streamed blocks on the device

    # -- events of a forward ------------------------------------------------------------

    def begin(self, component: str) -> None:
        """A selected component's forward starts: learn the order, prefetch its first block."""
        with self.lock:
            previous = self._call
            if previous is not None:
                self.successor[previous] = component
            run = previous[1] + 1 if previous is not None and previous[0] == component else 1
            self._call = (component, run)
            seq = self.sequences.get(component)
            if not seq or not self.prefetch:
                return
            first = seq[0]
            if first.on_device or self.running is not None:
                return
            if self.prefetched is not None:
                self._drop_prefetch()
            self._prefetch(first)

    def before(self, block: _Block) -> None:
        """Block ``block`` is about to run: make it resident, then prefetch its successor."""
        with self.lock:
            stale = self.running
            if stale is not None and stale is not block and stale.on_device:
                self._release(stale)  # its forward raised before the post-hook ran
            nxt = self._next(block)
            if block is self.prefetched:
                self.prefetched = None
                self._wait(block)
            elif not block.on_device:
                if self.prefetched is not None and self.prefetched is not nxt:
                    self._drop_prefetch()
                self._load(block, None)
                if self.prefetch:  # without prefetch every load is on demand, by design
                    self.stats.fallback_loads += 1
            self.running = block
            if (
                self.prefetch
                and nxt is not None
                and nxt is not block
                and not nxt.on_device
                and self.prefetched is None
            ):
                self._prefetch(nxt)
            self._note_peak()

    def after(self, block: _Block) -> None:
        """Block ``block`` has run (or raised): release its device copies."""
        with self.lock:
            if self.running is block:
                self.running = None
            if block.on_device and block is not self.prefetched:
                self._release(block)

    def quiesce(self) -> None:
        """Order the current stream after any copy in flight (``disable``)."""
        with self.lock:
            for block in (self.prefetched, self.running):
                if block is not None and block.on_device:
                    self._wait(block)

    # -- internals ------------------------------------------------------------------------

    def _next(self, block: _Block) -> _Block | None:
        seq = self.sequences[block.component]
        if block.index + 1 < len(seq):
            return seq[block.index + 1]
        call = self._call if self._call is not None and self._call[0] == block.component else None
        nxt = self.successor.get(call, block.component) if call is not None else block.component
        following = self.sequences.get(nxt)
        return following[0] if following else None

    def _note_peak(self) -> None:
        n = sum(1 for seq in self.sequences.values() for b in seq if b.on_device)
        self.max_on_device = max(self.max_on_device, n)

    def _wait(self, block: _Block) -> None:
        """The current stream waits on the block's load event (no host synchronize)."""
        if block.event is not None:
            self.platform.current_stream().wait_event(block.event)
            block.event = None

    def _prefetch(self, block: _Block) -> None:
        self._load(block, self.copy_stream)
        self.prefetched = block
        self.stats.prefetches += 1

    def _drop_prefetch(self) -> None:
        block, self.prefetched = self.prefetched, None
        if block is not None and block.on_device:
            self._wait(block)
            self._release(block, unchanged=True)

    def _load(self, block: _Block, stream: Any) -> None:
        """Queue the block's H2D copies and fingerprints on ``stream`` (None: current).

        All or nothing: on failure every tensor is back on the host.

        Raises:
            torch.OutOfMemoryError: the device cannot hold the block (named).
        """
        comp = block.weights
        start = time.perf_counter()
        txn = Transaction()
        try:
            with self.platform.use_stream(stream):
                comp.sync(txn)
                moved, _ = comp.load_slots(txn)
                event = None
                if stream is not None:
                    event = self.platform.new_event()
                    event.record(stream)
        except torch.OutOfMemoryError as exc:
            self._abort(txn, stream)
            raise torch.OutOfMemoryError(
                f"out of device memory while loading block {block.name!r} of component "
                f"{block.component!r} ({block.nbytes} bytes): {exc}"
            ) from exc
        except BaseException:
            self._abort(txn, stream)
            raise
        txn.commit()
        block.event = event
        block.on_device = True
        comp.resident = True
        if moved:
            comp._count("load", start)

    def _abort(self, txn: Transaction, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()  # no copy may still write what the rollback frees
        txn.rollback()

    @staticmethod
    def _host_ref(slots: list[Any], members: list[Member]) -> list[int]:
        """Fingerprints of the members' host copies, computed on the host."""
        views = []
        for slot in slots:
            for m in slot.members:
                views.append(slot.view(slot.host, m))
        with torch.inference_mode(False), torch.no_grad():
            return [int(x) for x in fingerprints(views).tolist()] if views else []

    @staticmethod
    def _fold(values: list[int]) -> int:
        """``sum((2i + 1) * v_i)`` modulo 2**64, as a signed 64-bit int (the device's fold)."""
        total = 0
        for i, v in enumerate(values):
            total = (total + (2 * i + 1) * v) & 0xFFFFFFFFFFFFFFFF
        return total - (1 << 64) if total >= 1 << 63 else total

    def _changed(
        self, block: _Block, slots: list[Any], members: list[Member], unchanged: bool
    ) -> tuple[list[bool], list[int] | None]:
        """Per member, whether its device bytes differ from its host copy (fingerprints:
        8 bytes read back, plus 8 per member when something differs), and the host
        references to keep once the changed members are written back (None: unchanged)."""
        if unchanged or not members or not self.check_writes:
            return [False] * len(members), None
        stats = self.stats
        if block.ref is None or [id(m) for m in members] != [id(m) for m in block.members]:
            block.ref, block.members = self._host_ref(slots, members), list(members)
        with torch.inference_mode(False), torch.no_grad():
            now = fingerprints([m.payload for m in members])
            weights = torch.arange(len(members), device=now.device, dtype=torch.int64).mul_(2).add_(1)
            stats.fingerprints += len(members)
            stats.fingerprint_bytes += sum(m.nbytes for m in members)
            stats.check_d2h_bytes += 8
            folded = int((now * weights).sum().item())
            if folded == self._fold(block.ref):
                return [False] * len(members), None
            stats.check_d2h_bytes += 8 * len(members)
            values = [int(x) for x in now.tolist()]
        return [v != r for v, r in zip(values, block.ref)], values

    def _order_release(self) -> None:
        """Order the copy stream after the compute queued so far (an event, no host wait):
        memory freed now may be reused by the next prefetch only after that compute."""
        if self.copy_stream is not None:
            done = self.platform.new_event()
            done.record(self.platform.current_stream())
            self.copy_stream.wait_event(done)

    def _release(self, block: _Block, unchanged: bool = False) -> None:
        """Write back what changed, then drop the block's device copies once the copy
        stream is ordered after the compute that read them."""
        comp = block.weights
        mover = comp.mover
        start = time.perf_counter()
        keep = {id(s) for b in (self.running, self.prefetched) if b is not None and b is not block for s in b.weights.slots}
        slots = [
            s for s in comp.slots
            if s.evictable and id(s) not in keep and s.on_device(self.device)
        ]
        txn = Transaction()
        try:
            members = [m for s in slots for m in s.members]
            changed, new_ref = self._changed(block, slots, members, unchanged)
            mover.evict(slots, txn, changed)
            self._order_release()
        except BaseException:
            txn.rollback()
            raise
        txn.commit()  # the device copies are freed here
        if new_ref is not None:
            block.ref = new_ref  # what the host copies hold now
        block.event = None
        block.on_device = False
        comp.resident = False
        if slots:
            comp._count("evict", start)


class _BlockHooks:
    """The forward pre-hook and post-hook of one streamed block, and their removal."""

    def __init__(self, module: nn.Module, block: _Block, streamer: BlockStreamer) -> None:
        self.module_ref = weakref.ref(module)
        self.block = block
        self.streamer_ref = weakref.ref(streamer)
        self._handles: list[Any] = []

    def install(self) -> None:
        module = self.module_ref()
        if module is None:
            return
        block, streamer_ref = self.block, self.streamer_ref

        @torch.compiler.disable
        def pre(mod: nn.Module, args: tuple) -> None:
            streamer = streamer_ref()
            if streamer is not None:
                streamer.before(block)

        @torch.compiler.disable
        def post(mod: nn.Module, args: tuple, output: Any) -> None:
            streamer = streamer_ref()
            if streamer is not None:
                streamer.after(block)

        self._handles = [
            module.register_forward_pre_hook(pre),
            module.register_forward_hook(post, always_call=True),
        ]

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def reinstall(self) -> None:
        self.install()


class _BeginHook:
    """A forward pre-hook on a selected component's root: prefetch its first block."""

    def __init__(self, module: nn.Module, component: str, streamer: BlockStreamer) -> None:
        self.module_ref = weakref.ref(module)
        self.component = component
        self.streamer_ref = weakref.ref(streamer)
        self._handle: Any = None

    def install(self) -> None:
        module = self.module_ref()
        if module is None:
            return
        component, streamer_ref = self.component, self.streamer_ref

        @torch.compiler.disable
        def begin(mod: nn.Module, args: tuple) -> None:
            streamer = streamer_ref()
            if streamer is not None:
                streamer.begin(component)

        self._handle = module.register_forward_pre_hook(begin, prepend=True)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def reinstall(self) -> None:
        self.install()


class LayerwiseOffloadBackend(OffloadBackendBase):
    """Layer mode: selected components keep their trunk resident and stream their blocks.

    Args:
        config: a ``DiffusionOffloadConfig`` or mapping/JSON with ``mode="layer"``;
            ``layer_options`` per component: ``resident_layers`` (``dit`` only: the first k
            blocks of each selected DiT stay on the device) and ``weight_transfer``
            (``"rank-local"``, the default; ``"allgather"`` is not implemented).
        device: the accelerator; ``cpu`` makes offload a no-op.
        layer_blocks: container paths per component name, overriding the class
            attribute ``_layerwise_offload_blocks_attrs`` and the built-in table
            (``{"transformer": ["blocks"]}``).
        prefetch: copy block i+1 while block i runs (default). False loads each block
            when it runs: the same results, for measuring what prefetch saves.
        check_writes: detect weights written while on the device and write them back
            (default; costs an 8-byte read-back, and so a host wait, per block release).
            False: for pure inference, device->host traffic is exactly the pipeline's
            own, and a write to a streamed weight while it is on the device is lost.
        component_roles, max_pinned_bytes: as ``ModelLevelOffloadBackend``.

    Peak device memory: trunks of the selected components + resident layers + the two
    largest streamed blocks + unselected components + activations (SPEC section 10).

    Raises:
        TypeError, ValueError: an invalid config, ``layer_blocks`` or device.
        NotImplementedError: ``weight_transfer="allgather"`` (distributed layer offload,
            which gathers sharded blocks across ranks, is not implemented).
    """

    MODE = "layer"

    def __init__(
        self,
        config: DiffusionOffloadConfig | Mapping[str, Any] | str,
        device: str | torch.device | int,
        *,
        layer_blocks: Mapping[str, Sequence[str]] | None = None,
        prefetch: bool = True,
        check_writes: bool = True,
        component_roles: Mapping[str, str] | None = None,
        max_pinned_bytes: int | None = None,
    ) -> None:
        super().__init__(
            config, device, component_roles=component_roles, max_pinned_bytes=max_pinned_bytes
        )
        for comp, opts in self.config.layer_options:
            if opts.weight_transfer == "allgather":
                raise NotImplementedError(
                    f"layer_options[{comp!r}].weight_transfer='allgather' needs distributed "
                    "layer offload (gathering sharded blocks across ranks), which is not "
                    "implemented; use 'rank-local' (the default)"
                )
        if layer_blocks is not None:
            if not isinstance(layer_blocks, Mapping):
                raise TypeError(
                    f"layer_blocks must be a mapping component name -> list of container "
                    f"paths, got {layer_blocks!r}"
                )
            for key, paths in layer_blocks.items():
                if not isinstance(key, str):
                    raise TypeError(f"layer_blocks keys must be component names (str), got {key!r}")
                if isinstance(paths, str) or not isinstance(paths, (list, tuple)) or not all(
                    isinstance(p, str) and p for p in paths
                ):
                    raise TypeError(
                        f"layer_blocks[{key!r}] must be a list of container paths (str), got {paths!r}"
                    )
        if not isinstance(prefetch, bool):
            raise TypeError(f"prefetch must be a bool, got {prefetch!r}")
        if not isinstance(check_writes, bool):
            raise TypeError(f"check_writes must be a bool, got {check_writes!r}")
        self.check_writes = check_writes
        self.layer_blocks = {k: list(v) for k, v in (layer_blocks or {}).items()}
        self.prefetch = prefetch
        self.streamer: BlockStreamer | None = None

    # ------------------------------------------------------------------ public API

    def resident_layers(self, role: str) -> int:
        """The configured ``resident_layers`` for ``role`` (0 when unset)."""
        for comp, opts in self.config.layer_options:
            if comp == role and opts.resident_layers is not None:
                return opts.resident_layers
        return 0

    @property
    def blocks(self) -> dict[str, list[str]]:
        """Streamed block names per selected component, in execution order."""
        if self.streamer is None:
            return {}
        return {c: [b.name for b in seq] for c, seq in self.streamer.sequences.items()}

    def disable(self) -> None:
        """Remove every hook; tensors stay where they are (see ``OffloadBackendBase``).

        A block copy still in flight is ordered before anything the caller runs next.
        """
        with self.lock:
            if self.streamer is not None and self._enabled:
                self.streamer.quiesce()
            super().disable()
            if not self._enabled:
                self.streamer = None

    def audit(self) -> list[str]:
        """Every breach of layer mode's residency invariant; ``[]`` when all holds.

        Checked: every tensor of a trunk, a resident layer or an unselected component is
        on the device; every tensor of a streamed block is on the side its block state
        says; no tensor of a component is unmanaged; at most two streamed blocks are on
        the device. O(tensors), for tests and debugging.
        """
        with self.lock:
            if not self._enabled or self._table is None or self.streamer is None:
                return []
            out = self._placement_breaches()
            on_device = [
                f"{b.component}.{b.name}"
                for seq in self.streamer.sequences.values()
                for b in seq
                if b.on_device
            ]
            if len(on_device) > 2:
                out.append(f"more than two streamed blocks on the device: {on_device}")
            return out

    # ------------------------------------------------------------------ internals

    def _check_selection(self, components: list[Component]) -> None:
        roles = {c.name: c.role for c in components}
        for wanted in self.config.components:
            if wanted not in roles.values():
                raise ValueError(
                    f"components includes {wanted!r} but the pipeline has no {wanted.replace('_', ' ')}; "
                    f"discovered: {roles}"
                )
        unknown = sorted(set(self.layer_blocks) - set(roles))
        if unknown:
            raise ValueError(
                f"layer_blocks names {unknown}, which are not components of this pipeline; "
                f"components: {sorted(roles)}"
            )

    def _streams(self, comp: Component) -> bool:
        return comp.role in _STREAMED_ROLES and self.config.selects(comp.role)

    def _enable(self, components: list[Component]) -> None:
        found: dict[str, list[tuple[str, nn.Module]]] = {}
        for comp in components:
            if self._streams(comp):
                blocks = discover_blocks(comp.module, self.layer_blocks.get(comp.name), component=comp.name)
                if comp.role == "dit":
                    blocks = blocks[self.resident_layers("dit"):]
                found[comp.name] = blocks
        check_disjoint(found)
        table = WeightTable(self.mover)
        named: dict[str, list[tuple[str, torch.Tensor]]] = {}
        selected: dict[str, bool] = {}
        block_weights: dict[str, list[tuple[str, nn.Module, ComponentWeights]]] = {}
        for comp in components:
            streamed = [b for _, b in found.get(comp.name, [])]
            trunk = table.add(comp.name, comp.role, False, comp.module, skip=streamed)
            named[comp.name] = trunk.named_tensors()
            selected[comp.name] = False
            for bname, bmod in found.get(comp.name, []):
                key = f"{comp.name}.{bname}"
                w = table.add(key, "block", True, bmod)
                named[key] = w.named_tensors()
                selected[key] = True
                block_weights.setdefault(comp.name, []).append((bname, bmod, w))
        streamer = BlockStreamer(self.platform, self.mover, self.lock, self.prefetch, self.check_writes)

        def install(weights: dict[str, ComponentWeights], handles: list[Any]) -> None:
            for comp in components:
                hook = None
                if comp.role in _STAGE_ROLES:
                    hook = SequentialOffloadHook(weights[comp.name], (), (), self.lock)
                handles.append(attach_hook(comp.module, hook, comp.name, child_hooks=False))
            for cname, entries in block_weights.items():
                seq = [_Block(cname, i, bname, w) for i, (bname, _, w) in enumerate(entries)]
                streamer.sequences[cname] = seq
                for block, (_, bmod, _) in zip(seq, entries):
                    h = _BlockHooks(bmod, block, streamer)
                    handles.append(h)  # first: a partly installed handle is removed too
                    h.install()
                module = next(c.module for c in components if c.name == cname)
                begin = _BeginHook(module, cname, streamer)
                handles.append(begin)
                begin.install()
            self.streamer = streamer

        self._transact_enable(table, named, selected, install)

    def _at_rest_on_host(self, weights: ComponentWeights) -> bool:
        """Layer mode: the streamed blocks rest on the host, everything else on the device."""
        return weights.selected

    def __repr__(self) -> str:
        state = "enabled" if self._enabled else "disabled"
        return f"LayerwiseOffloadBackend({self.config.to_json()}, {self.device}, {state})"
