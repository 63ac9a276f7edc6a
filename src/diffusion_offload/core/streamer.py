"""``LayerwiseOffloadBackend``: layer mode, block-streamed components (SPEC section 10).

Each selected component (DiT, text encoder) keeps its *trunk* on the device (embeddings,
norms, heads: everything outside its blocks) and streams its blocks: the next block is
copied host->device on a dedicated copy stream while the current one computes, so during
a forward at most the running block and one prefetched block sit on the device, across
all components (a block that calls another streamed block keeps both while they run).
Outside a forward at most one streamed block is on the device: the *carried prefetch*,
the next call's first block. Unselected components stay resident. There is no mutual
exclusion between components: each streams its own blocks.

Ordering, on platforms with streams (CUDA, XPU, NPU, the fake device):

* a block's load (its H2D copies) is queued on the copy stream and followed by an event;
  before the block runs, the compute stream waits on that event (never a device-wide
  synchronize) and the block's device tensors are recorded on the compute stream
  (``record_stream``), so whoever drops them later (our release, diffusers' layerwise
  casting replacing an fp8 weight) frees them only after the compute that read them;
* at the end of every stage call the compute stream waits on the carried prefetch's
  event, so whatever the caller runs between requests (a read, an in-place write,
  ``fuse_lora``) is ordered after that copy, and the pipeline's own read of its output
  orders the host too: no host wait is added;
* a load is copies only. A release fingerprints the block's tensors on the device, folds
  them into one 64-bit word and reads back those 8 bytes, to compare with the same fold
  of the host copies' fingerprints (computed on the host, once per block, and updated at
  every write-back; the fingerprint is exact integer arithmetic, equal on any device).
  Only when they differ are the per-tensor fingerprints read back, and the tensors that
  changed written back, as module mode does (section 4). Dropping a prefetch that guessed
  wrong is a release like any other: a write made to it meanwhile is written back.

Other platforms copy synchronously on the current stream.

The schedule is learned from the calls observed (``BlockStreamer``): the blocks a
component's previous call ran, in order, and which call followed which. A block that
does not run is never prefetched once a call has been observed, and from the second
request on identical requests copy identical bytes: the blocks that run, once per call.
A block that runs without having been prefetched is loaded synchronously
(``stats.fallback_loads``). A device out-of-memory error inside a stage call drops the
prefetch and every block left on the device, empties the cache and reruns the call once
without prefetch; a second one raises ``StageOutOfMemoryError``. Every load and release is
all-or-nothing, and the streamer's state changes only once a move succeeded.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
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
from .transfer import Member, Mover, Transaction, fingerprints, record_on

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


#: a call of a stage module: (component name, its run length: 1 for the first of
#: consecutive calls of the same component, 2 for the next...)
CallKey = tuple[str, int]

#: successors remembered at most (a pipeline's stage sequence is short; a model called
#: forever without another stage would otherwise add one key per call)
_MAX_SUCCESSORS = 4096


class BlockStreamer:
    """Moves streamed blocks for one backend: the blocks that run, loaded ahead of use.

    Args:
        platform: the device's platform (streams, events).
        mover: the backend's mover (its ``stats`` count prefetches and fallbacks).
        lock: the backend's lock (activations from several threads are serialized).
        prefetch: copy the next block ahead of use (on the copy stream where the
            platform has streams). False: every block loads synchronously just before it
            is needed, and a component's first block before its forward starts, so
            results and what the model sees (``param.device``) are the same.
        check_writes: compare each released block with its host copy (8 bytes read
            back) and write changed weights back. False trusts that nothing writes the
            weights while they are on the device (pure inference): no read-back, no
            host wait per block, and a write to a streamed weight is lost.

    The schedule is learned from the calls observed, never assumed:

    * within a call, the next block is the one that followed this block in the
      component's previous call (``order``); until a call was observed, or where the
      call departs from it, the container's order stands in;
    * after a call's last block, the next call is predicted from ``successor`` (the call
      that followed this one, keyed by run length, so "the text encoder twice, then each
      DiT 2 x steps times" is exact from the second request on); its first block is
      prefetched during the last block. A request boundary (the successor is the first
      call ever observed) is never crossed from a block: a non-streamed stage in
      between (the VAE's decode) prefetches the next request's first block instead, or
      the first call loads it when it starts;
    * a block that did not run in the previous call is never prefetched, and a block that
      runs twice in a row stays on the device between its runs.

    Invariants (``LayerwiseOffloadBackend.audit`` checks them): outside any forward at
    most one streamed block is on the device, the carried prefetch, and its copy is
    ordered before any later work on the stream that ran the call (``stream.wait_event``,
    no host wait), with its memory recorded on that stream (``record_stream``); during a
    forward at most the running blocks (nested calls: several) and one prefetch.
    Every load and release is all-or-nothing; the streamer's own state changes only after
    a move succeeded, so an interrupted move leaves no block unaccounted for.

    Attributes:
        sequences: component name -> its streamed blocks in container order.
        order: component name -> the blocks its last completed call ran, in order.
        stack: ``(block, position in its call)`` of every block whose forward is running.
        prefetched: the block being (or already) copied ahead of use, or None.
        successor: call key -> the call key that followed it, as last observed.
        cycle_start: the first call observed (a request's start).
        retries: forwards retried after a device out-of-memory error.
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
        self.order: dict[str, list[_Block]] = {}
        self.stack: list[tuple[_Block, int]] = []
        self.prefetched: _Block | None = None
        self.successor: dict[CallKey, CallKey] = {}
        self.cycle_start: CallKey | None = None
        self.retries = 0
        self._call: CallKey | None = None  # the call running now, or the last one
        self._trace: dict[str, list[_Block]] = {}  # blocks run so far by each running call
        self._synchronous = 0  # > 0 during an out-of-memory retry: no prefetch
        self._last_block: _Block | None = None  # the block loaded or begun last (OOM messages)
        self.max_on_device = 0  # high-water mark of streamed blocks on the device

    # -- queries ------------------------------------------------------------------------

    @property
    def running(self) -> _Block | None:
        """The innermost block whose forward is running, or None."""
        return self.stack[-1][0] if self.stack else None

    def on_device(self) -> list[_Block]:
        """Every streamed block whose device copy exists now."""
        return [b for seq in self.sequences.values() for b in seq if b.on_device]

    @property
    def _prefetching(self) -> bool:
        return self.prefetch and not self._synchronous

    # -- a stage module's call (``_StageEntry``) ----------------------------------------

    def call(self, component: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (the forward/decode of stage ``component``) under the streamer.

        Before: learn the order of calls and make the call's first block resident or
        prefetched (a non-streamed stage prefetches the next streamed call's first
        block). After, also when ``fn`` raised: release any block left on the device but
        the carried prefetch, and order the current stream after that prefetch's copy.
        A device out-of-memory error drops the prefetch, empties the cache and runs
        ``fn`` once more without prefetch.

        Raises:
            StageOutOfMemoryError: the retry ran out of device memory too (names the
                stage, the block and its bytes).
            BaseException: whatever ``fn`` raised otherwise.
        """
        try:
            first: str | None = None
            try:
                self._enter(component)
                out = fn()
            except torch.OutOfMemoryError as exc:
                first = str(exc)  # leave the handler: its traceback holds the activations
            if first is not None:
                self._recover(component, first)
                self._synchronous += 1
                try:
                    self._enter(component, retry=True)
                    out = fn()
                except torch.OutOfMemoryError as exc:
                    raise self._stage_oom(component, exc) from exc
                finally:
                    self._synchronous -= 1
        except BaseException:
            self._exit(component, completed=False)
            raise
        self._exit(component, completed=True)
        return out

    def _key(self, component: str) -> CallKey:
        previous = self._call
        run = previous[1] + 1 if previous is not None and previous[0] == component else 1
        return (component, run)

    def _enter(self, component: str, retry: bool = False) -> None:
        with self.lock:
            if retry:
                key = self._call if self._call is not None else (component, 1)
            else:
                key = self._key(component)
                if self._call is not None and len(self.successor) < _MAX_SUCCESSORS:
                    self.successor[self._call] = key
                if self.cycle_start is None:
                    self.cycle_start = key
                self._call = key
            if component in self.sequences:
                self._trace[component] = []
                self._drop_stack(component)
                first = self._first(component)
                self._sweep(keep=first)
                if first is None or first.on_device:
                    return
                if self._prefetching:
                    if self.prefetched is not None:
                        self._drop_prefetch()
                    self._prefetch(first)
                else:  # resident before the forward body runs, as with prefetch
                    self._load(first, None)
                self._note_peak()
                return
            nxt = self._after_stage(key)
            if nxt is None or not self._prefetching:
                return
            first = self._first(nxt[0])
            if first is None or first is self.prefetched or first.on_device:
                return
            if self.stack:
                return  # a stage called inside a streamed block: no room to plan for
            self._drop_prefetch()
            self._prefetch(first)

    def _exit(self, component: str, completed: bool) -> None:
        with self.lock:
            if component in self.sequences:
                trace = self._trace.pop(component, None)
                if completed and trace is not None:
                    self.order[component] = trace
                self._drop_stack(component)
                if completed and not self.stack:
                    self._repredict(component)
            if not self.stack:
                self._sweep(keep=self.prefetched)
            if self.prefetched is not None:
                self._wait(self.prefetched)  # later work on this stream follows the copy

    def _repredict(self, component: str) -> None:
        """At the end of a call, with what it ran known: a prefetch that guessed wrong (the
        container's order, before any call was observed) is replaced by the next call's
        first block, or dropped at a request boundary."""
        nxt = self._next_call(component)
        if self.prefetched is nxt:
            return
        self._drop_prefetch()
        if nxt is not None and not nxt.on_device and self._prefetching:
            self._prefetch(nxt)

    def _drop_stack(self, component: str) -> None:
        """Forget running entries of ``component`` (a forward that raised
        ``KeyboardInterrupt`` skips the blocks' post-hooks)."""
        self.stack = [(b, i) for b, i in self.stack if b.component != component]

    def _sweep(self, keep: _Block | None) -> None:
        """Release every streamed block on the device that is neither running, nor
        ``keep``, nor the prefetch. A release that fails leaves its block on the device
        as the carried block when there is none (it is consistent: every tensor on one
        side), else re-raises after the others were tried."""
        running = {id(b) for b, _ in self.stack}
        failure: BaseException | None = None
        for block in self.on_device():
            if id(block) in running or block is keep or block is self.prefetched:
                continue
            try:
                self._release(block)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                if self.prefetched is None:
                    self.prefetched = block
                if failure is None:
                    failure = exc
        if failure is not None:
            raise failure

    def _recover(self, component: str, exc: str) -> None:
        """The first device OOM of a call: drop the prefetch and every block left on the
        device, empty the cache."""
        with self.lock:
            self.retries += 1
            self._drop_stack(component)
            self._drop_prefetch()
            self._sweep(keep=None)
            self.platform.empty_cache()
            logger.info("layer mode: %s ran out of device memory (%s); retrying without prefetch", component, exc)

    def _stage_oom(self, component: str, exc: BaseException) -> Exception:
        from .policy import StageOutOfMemoryError

        block = self._last_block
        where = (
            f"at block {block.name!r} of {block.component!r} ({block.nbytes} bytes)"
            if block is not None
            else "before any streamed block"
        )
        stats = self.platform.memory_stats()
        return StageOutOfMemoryError(
            f"stage {component!r} ran out of device memory twice in layer mode, {where}: "
            f"after the first error it dropped the prefetched block and emptied the cache, "
            f"then ran out again with {stats.allocated_bytes} bytes allocated on the device; "
            f"use a smaller shape, fewer resident_layers or more offload: {exc}"
        )

    # -- a block's forward (``_BlockHooks``) -------------------------------------------

    def before(self, block: _Block) -> None:
        """Block ``block`` is about to run: make it resident, then prefetch its successor."""
        with self.lock:
            trace = self._trace.get(block.component)
            if trace is None:  # a block called outside its component's forward
                trace = self._trace[block.component] = []
            pos = len(trace)
            trace.append(block)
            self._last_block = block
            nxt = self._next(block, pos)
            if block is self.prefetched:
                self._wait(block)
                self.prefetched = None
            elif not block.on_device:
                if self.prefetched is not None and self.prefetched is not nxt:
                    self._drop_prefetch()
                self._load(block, None)
                if self._prefetching:  # without prefetch every load is on demand, by design
                    self.stats.fallback_loads += 1
            self.stack.append((block, pos))
            if (
                self._prefetching
                and nxt is not None
                and nxt is not block
                and not nxt.on_device
                and self.prefetched is None
            ):
                self._prefetch(nxt)
            self._note_peak()

    def after(self, block: _Block) -> None:
        """Block ``block`` has run (or raised): release its device copies, unless it runs
        again next or is still running further out (a nested call)."""
        with self.lock:
            pos = None
            for i in range(len(self.stack) - 1, -1, -1):
                if self.stack[i][0] is block:
                    pos = self.stack.pop(i)[1]
                    break
            if any(b is block for b, _ in self.stack) or not block.on_device or block is self.prefetched:
                return
            if pos is not None and self._next(block, pos) is block and self.prefetched is None:
                self.prefetched = block  # it runs again at once: keep it
                return
            self._release(block)

    def quiesce(self) -> None:
        """Order the current stream after any copy in flight, and record the blocks'
        device memory on it (``disable``: the tensors stay in the model)."""
        with self.lock:
            for block in self.on_device():
                self._wait(block)

    # -- the schedule -------------------------------------------------------------------

    def _first(self, component: str) -> _Block | None:
        """The block a call of ``component`` runs first: as in its running or last call
        (None: it ran no block), or its first block before any call was observed."""
        trace = self._trace.get(component)
        if trace:
            return trace[0]
        order = self.order.get(component)
        if order is not None:
            return order[0] if order else None
        seq = self.sequences.get(component)
        return seq[0] if seq else None

    def _next(self, block: _Block, pos: int) -> _Block | None:
        """The block expected after ``block``, the ``pos``-th of its call."""
        order = self.order.get(block.component)
        if order is not None and pos < len(order) and order[pos] is block:
            if pos + 1 < len(order):
                return order[pos + 1]
            return self._next_call(block.component)
        seq = self.sequences[block.component]
        if block.index + 1 < len(seq):
            return seq[block.index + 1]
        return self._next_call(block.component)

    def _next_call(self, component: str) -> _Block | None:
        """The first block of the call expected after the current one of ``component``,
        unless that call starts a request or is not streamed."""
        key = self._call if self._call is not None and self._call[0] == component else (component, 1)
        nxt = self.successor.get(key, (component, key[1] + 1))
        if nxt == self.cycle_start or nxt[0] not in self.sequences:
            return None
        return self._first(nxt[0])

    def _after_stage(self, key: CallKey) -> CallKey | None:
        """The streamed call expected after non-streamed stage ``key``: follow the observed
        successors (the first call observed when ``key``'s is unknown)."""
        nxt = self.successor.get(key)
        if nxt is None and key != self.cycle_start:
            nxt = self.cycle_start
        for _ in range(64):
            if nxt is None or nxt[0] in self.sequences:
                return nxt
            nxt = self.successor.get(nxt)
        return None

    # -- moves --------------------------------------------------------------------------

    def _note_peak(self) -> None:
        self.max_on_device = max(self.max_on_device, len(self.on_device()))

    def _wait(self, block: _Block) -> None:
        """Hand the block's copy to the current stream: it waits on the load event (no host
        synchronize) and its device memory is recorded on it, so whoever frees a tensor
        later (our release, layerwise casting replacing it) cannot free it under
        pending work."""
        if block.event is None:
            return
        stream = self.platform.current_stream()
        stream.wait_event(block.event)
        block.event = None
        self._record(block, stream)

    def _record(self, block: _Block, stream: Any) -> None:
        """``record_stream(stream)`` on every device payload of the block."""
        record_on(stream, (m for slot in block.weights.slots for m in slot.members), self.device)

    def _prefetch(self, block: _Block) -> None:
        self._load(block, self.copy_stream)
        self.prefetched = block
        self.stats.prefetches += 1

    def _drop_prefetch(self) -> None:
        """Release the prefetched block (write-checked: it may have been written while it
        waited); the streamer forgets it only once the release succeeded."""
        block = self.prefetched
        if block is None:
            return
        if block.on_device:
            self._wait(block)
            self._release(block)
        self.prefetched = None

    def _load(self, block: _Block, stream: Any) -> None:
        """Queue the block's H2D copies on ``stream`` (None: the current one).

        All or nothing: on failure every tensor is back on the host.

        Raises:
            torch.OutOfMemoryError: the device cannot hold the block (named).
        """
        comp = block.weights
        self._last_block = block
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

    def _release(self, block: _Block, unchanged: bool = False) -> None:
        """Write back what changed, then drop the block's device copies. A prefetched
        block's memory was recorded on the stream that ran it (``_wait``), so the caching
        allocator reuses it only after that compute. All or nothing: on failure the block
        is still on the device, every tensor in place."""
        comp = block.weights
        mover = comp.mover
        start = time.perf_counter()
        others = [b for b, _ in self.stack] + [self.prefetched]
        keep = {id(s) for b in others if b is not None and b is not block for s in b.weights.slots}
        slots = [
            s for s in comp.slots
            if s.evictable and id(s) not in keep and s.on_device(self.device)
        ]
        txn = Transaction()
        try:
            members = [m for s in slots for m in s.members]
            changed, new_ref = self._changed(block, slots, members, unchanged)
            mover.evict(slots, txn, changed)
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

    @property
    def active(self) -> bool:
        """Whether both hooks are installed."""
        return len(self._handles) == 2

    def remove(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def reinstall(self) -> None:
        """Install again (after a removal, complete or not)."""
        self.remove()
        self.install()


class _StageEntry:
    """Wraps a stage module's entry points (``forward``; a VAE's ``decode``/``encode``)
    so that each outermost call runs through ``BlockStreamer.call``.

    Installed after the module's ``HookHandle``, so it is outermost; removal restores
    what it replaced when it is still outermost, else it becomes a pass-through.
    """

    def __init__(self, module: nn.Module, component: str, names: Sequence[str], streamer: BlockStreamer) -> None:
        self.module_ref = weakref.ref(module)
        self.component = component
        self.names = list(names)
        self.streamer_ref = weakref.ref(streamer)
        self.active = False
        self.depth = 0  # calls of this module in progress (decode inside forward...)
        self._saved: dict[str, Any] = {}
        self._wrappers: dict[str, Callable[..., Any]] = {}

    def _wrap(self, module: nn.Module, name: str) -> Callable[..., Any]:
        previous = module.__dict__.get(name)
        unbound = getattr(type(module), name)
        module_ref, entry = self.module_ref, self

        def stage_entry(*args: Any, **kwargs: Any) -> Any:
            mod = module_ref()
            if mod is None:
                raise ReferenceError("the offloaded module was deleted")

            def run() -> Any:
                if previous is not None:
                    return previous(*args, **kwargs)
                return unbound(mod, *args, **kwargs)

            streamer = entry.streamer_ref()
            if not entry.active or entry.depth or streamer is None or torch.compiler.is_compiling():
                return run()
            entry.depth += 1
            try:
                return streamer.call(entry.component, run)
            finally:
                entry.depth -= 1

        stage_entry.__wrapped__ = unbound  # type: ignore[attr-defined]
        stage_entry.__doc__ = unbound.__doc__
        stage_entry.__name__ = name
        return stage_entry

    def install(self) -> None:
        module = self.module_ref()
        if module is None:
            return
        for name in self.names:
            self._saved[name] = module.__dict__.get(name)
            self._wrappers[name] = self._wrap(module, name)
            module.__dict__[name] = self._wrappers[name]
        self.active = True

    def remove(self) -> None:
        self.active = False
        module = self.module_ref()
        if module is not None:
            for name, wrapper in self._wrappers.items():
                if module.__dict__.get(name) is wrapper:
                    previous = self._saved.get(name)
                    if previous is not None:
                        module.__dict__[name] = previous
                    else:
                        del module.__dict__[name]
        self._saved.clear()
        self._wrappers.clear()

    def reinstall(self) -> None:
        """Install again after ``remove`` (a rolled-back ``disable``)."""
        if not self.active:
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

        A block left on the device (the carried prefetch) stays in the model: its copy is
        ordered before anything the caller queues next on the current stream, and its
        device memory is recorded on that stream, so whoever frees it later frees it
        safely.
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
        says; no tensor of a component is unmanaged; outside a forward, no streamed block
        is on the device but the carried prefetch; during one, at most the running blocks
        and one prefetch. O(tensors), for tests and debugging.
        """
        with self.lock:
            if not self._enabled or self._table is None or self.streamer is None:
                return []
            out = self._placement_breaches()
            streamer = self.streamer
            allowed = {id(b) for b, _ in streamer.stack}
            if streamer.prefetched is not None:
                allowed.add(id(streamer.prefetched))
            extra = [f"{b.component}.{b.name}" for b in streamer.on_device() if id(b) not in allowed]
            if extra:
                out.append(
                    f"streamed blocks on the device that neither run nor are prefetched: {extra}"
                )
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
            for cname, entries in block_weights.items():
                streamer.sequences[cname] = [
                    _Block(cname, i, bname, w) for i, (bname, _, w) in enumerate(entries)
                ]
            for comp in components:
                hook = None
                if comp.role in _STAGE_ROLES:
                    hook = SequentialOffloadHook(weights[comp.name], (), (), self.lock)
                handles.append(attach_hook(comp.module, hook, comp.name, child_hooks=False))
                if comp.role in _STAGE_ROLES:
                    names = ["forward"]
                    if comp.role == "vae":
                        names += [n for n in ("decode", "encode") if callable(getattr(type(comp.module), n, None))]
                    entry = _StageEntry(comp.module, comp.name, names, streamer)
                    handles.append(entry)  # first: a partly installed handle is removed too
                    entry.install()
            for cname, entries in block_weights.items():
                for block, (_, bmod, _) in zip(streamer.sequences[cname], entries):
                    h = _BlockHooks(bmod, block, streamer)
                    handles.append(h)
                    h.install()
            self.streamer = streamer

        self._transact_enable(table, named, selected, install)

    def _at_rest_on_host(self, weights: ComponentWeights) -> bool:
        """Layer mode: the streamed blocks rest on the host, everything else on the device."""
        return weights.selected

    def __repr__(self) -> str:
        state = "enabled" if self._enabled else "disabled"
        return f"LayerwiseOffloadBackend({self.config.to_json()}, {self.device}, {state})"
