"""``BlockStreamer``: moves the streamed blocks of layer mode (SPEC section 10), ahead of use.

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
* a load is one H2D copy per arena (the block's host copies packed together,
  ``arena``). Every release is write-checked on the device: the arena's sums are
  computed there, read back (one host wait) and compared with the same sums of its host
  copy (``checks.changed``, computed on the host once and again after a write-back);
  what changed is written back (``checks.compare_with_host`` finds which tensors). The
  host alone cannot judge a block that ran: an in-place op on ``p.data`` in its forward
  or in a hook changes neither its version counter nor its storage. The wait comes after
  the block's compute was queued and the next block's copy was queued on the copy
  stream, so the copy engine stays busy; what it costs is the host's lead over the
  device (the next block's kernels are queued once this one finished). The carried
  block, which sits on the device across a call's boundary where the caller's code may
  write it, is checked on the device when the next stage call starts: unchanged, it
  counts as loaded in that call; changed, it is written back and released. Dropping a prefetch
  that guessed wrong is a release like any other. ``check_writes=False`` skips every
  device check, for inference that writes no weight in place (a ``.data =`` replacement
  is still seen, on the host).

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
from collections.abc import Callable
from typing import Any

import torch

from .platform import Platform
from .residency import ComponentWeights
from .transfer import Member, Mover, Transaction, record_on

__all__ = ["BlockStreamer", "CallKey", "StreamedBlock"]

logger = logging.getLogger(__name__)


class StreamedBlock:
    """One streamed block: its weights, its place in its component, its device state."""

    __slots__ = (
        "component", "index", "name", "weights", "event", "on_device", "carried", "__weakref__",
    )

    def __init__(self, component: str, index: int, name: str, weights: ComponentWeights) -> None:
        self.component = component
        self.index = index
        self.name = name
        self.weights = weights
        self.event: Any = None  # recorded on the copy stream after the load
        self.on_device = False
        self.carried = False  # on the device across a stage call's boundary, not yet verified

    @property
    def nbytes(self) -> int:
        """Bytes that stream for this block: its arena, alignment padding included
        (``ComponentWeights.transfer_bytes``)."""
        return self.weights.transfer_bytes

    def __repr__(self) -> str:
        return f"StreamedBlock({self.component}.{self.name}, {'device' if self.on_device else 'host'})"


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
        check_writes: check each released block for writes (its arenas' sums computed on
            the device and read back: one host wait a release) and write changed weights
            back. False trusts that nothing writes the weights in place while they are on
            the device (pure inference): no device check, and an in-place write to a
            streamed weight is lost; a replacement (``p.data = t``) is still seen on the
            host and kept.

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
        kept: blocks a layer-mode budget keeps on the device once loaded (never released,
            never prefetched again; ``choose_kept`` picks them at every request's start).
        choose_kept: ``calls -> blocks to keep``, called at the start of every request
            after the first with the forward calls per component of the request observed
            (None: no budget, nothing kept).
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
        self.sequences: dict[str, list[StreamedBlock]] = {}
        self.order: dict[str, list[StreamedBlock]] = {}
        self.stack: list[tuple[StreamedBlock, int]] = []
        self.prefetched: StreamedBlock | None = None
        self.successor: dict[CallKey, CallKey] = {}
        self.cycle_start: CallKey | None = None
        self.retries = 0
        self.kept: set[StreamedBlock] = set()
        self.choose_kept: Callable[[dict[str, int]], set[StreamedBlock]] | None = None
        self._unused: StreamedBlock | None = None  # the prefetch, until it runs
        self._skipping: set[str] = set()  # components whose running call skipped a block
        self._call: CallKey | None = None  # the call running now, or the last one
        self._trace: dict[str, list[StreamedBlock]] = {}  # blocks run so far by each running call
        self._synchronous = 0  # > 0 during an out-of-memory retry: no prefetch
        self._last_block: StreamedBlock | None = None  # the block loaded or begun last (OOM messages)
        self.max_on_device = 0  # high-water mark of streamed blocks on the device
        #: called as ``listener(event, block, start, end)`` (perf_counter seconds, host
        #: time) for every block ``"load"`` (synchronous), ``"prefetch"`` (queued on the
        #: copy stream), ``"release"`` and ``"host wait"`` (a device check's read-back)
        self.listeners: list[Callable[[str, StreamedBlock, float, float], None]] = []

    # -- queries ------------------------------------------------------------------------

    @property
    def running(self) -> StreamedBlock | None:
        """The innermost block whose forward is running, or None."""
        return self.stack[-1][0] if self.stack else None

    def on_device(self) -> list[StreamedBlock]:
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
                self._verify_carried()
                key = self._key(component)
                if self._call is not None and len(self.successor) < _MAX_SUCCESSORS:
                    self.successor[self._call] = key
                if self.cycle_start is None:
                    self.cycle_start = key
                elif key == self.cycle_start and self.choose_kept is not None:
                    calls = self._request_calls()
                    if calls is not None:
                        self.kept = self.choose_kept(calls)
                self._call = key
            if component in self.sequences:
                self._trace[component] = []
                self._skipping.discard(component)
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
                skipped = component in self._skipping
                self._skipping.discard(component)
                if completed and trace is not None and not skipped:
                    self.order[component] = trace  # a call a cache cut short keeps the order
                self._drop_stack(component)
                if completed and not self.stack:
                    self._repredict(component)
            if not self.stack:
                self._sweep(keep=self.prefetched)
            if self.prefetched is not None:
                self._wait(self.prefetched)  # later work on this stream follows the copy
                if not self.stack and self.check_writes:
                    self.prefetched.carried = True  # the caller's code may write it meanwhile

    def _verify_carried(self) -> None:
        """A new stage call starts: compare the carried block with its host copy (the
        arena's sums computed on the device, read back: one host wait, against the same
        sums of the host copy, ``checks.changed``). Unchanged, it counts as loaded in this
        call; changed (the caller's code wrote it, or reassigned a ``.data``), it is
        released now (what changed is written back) and loaded again when needed, which
        also follows a reassignment (``ComponentWeights.sync``)."""
        block = self.prefetched
        if block is None or not block.carried or not block.on_device:
            return
        comp = block.weights
        slots = [s for s in comp.slots if s.evictable and s.on_device(self.device)]
        waited = time.perf_counter()
        changed = comp.changed(slots)
        self._emit("host wait", block, waited)
        if any(changed):
            self.prefetched = None
            try:
                self._release(block, known=changed)
            except BaseException:
                self.prefetched = block
                raise
            return
        block.carried = False

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

    def _sweep(self, keep: StreamedBlock | None) -> None:
        """Release every streamed block on the device that is neither running, nor
        ``keep``, nor the prefetch. A release that fails leaves its block on the device
        as the carried block when there is none (it is consistent: every tensor on one
        side), else re-raises after the others were tried."""
        running = {id(b) for b, _ in self.stack}
        failure: BaseException | None = None
        for block in self.on_device():
            if id(block) in running or block is keep or block is self.prefetched or block in self.kept:
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
            self.kept = set()  # the budget's blocks go too (chosen again at the next request)
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

    def before(self, block: StreamedBlock) -> None:
        """Block ``block`` is about to run: make it resident, then prefetch its successor."""
        with self.lock:
            trace = self._trace.get(block.component)
            if trace is None:  # a block called outside its component's forward
                trace = self._trace[block.component] = []
            pos = len(trace)
            trace.append(block)
            self._last_block = block
            nxt = self._ahead(block, pos)
            if block is self._unused:
                self._unused = None
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

    def after(self, block: StreamedBlock) -> None:
        """Block ``block`` has run (or raised): release its device copies, unless it runs
        again next or is still running further out (a nested call)."""
        with self.lock:
            pos = None
            for i in range(len(self.stack) - 1, -1, -1):
                if self.stack[i][0] is block:
                    pos = self.stack.pop(i)[1]
                    break
            if (
                any(b is block for b, _ in self.stack)
                or not block.on_device
                or block is self.prefetched
                or block in self.kept
            ):
                return
            if pos is not None and self._next(block, pos) is block and self.prefetched is None:
                self.prefetched = block  # it runs again at once: keep it
                return
            self._release(block)

    def skip(self, block: StreamedBlock) -> None:
        """Block ``block``'s forward is called but its body will not run (a cache returns
        the cached output): it is neither loaded nor prefetched. A prefetch of it is
        dropped (counted in ``stats.wasted_prefetches``) and the next call's first block is
        prefetched instead; the call does not replace the learned order."""
        with self.lock:
            self._skipping.add(block.component)
            if block is not self.prefetched:
                return
            self._drop_prefetch()
            nxt = self._next_call(block.component)
            if nxt is not None and not nxt.on_device and self._prefetching:
                self._prefetch(nxt)

    def release_all(self) -> None:
        """Release every streamed block on the device: the prefetch, the carried block and
        the kept ones (they load again at their next call); ``sleep``, between calls.

        Raises:
            RuntimeError: a forward is running.
        """
        with self.lock:
            if self.stack:
                raise RuntimeError("a streamed forward is running: sleep() between requests")
            self._drop_prefetch()
            for block in self.on_device():
                self._wait(block)
                self._release(block)

    def quiesce(self) -> None:
        """Order the current stream after any copy in flight, and record the blocks'
        device memory on it (``disable``: the tensors stay in the model)."""
        with self.lock:
            for block in self.on_device():
                self._wait(block)

    # -- the schedule -------------------------------------------------------------------

    def _first(self, component: str) -> StreamedBlock | None:
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

    def _next(self, block: StreamedBlock, pos: int) -> StreamedBlock | None:
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

    def _ahead(self, block: StreamedBlock, pos: int) -> StreamedBlock | None:
        """The block to prefetch while ``block`` (the ``pos``-th of its call) runs: the
        next one, past the kept blocks already on the device that follow it in the
        learned order (so a streamed copy hides behind their compute too)."""
        nxt = self._next(block, pos)
        order = self.order.get(block.component) or []
        while (
            nxt is not None
            and nxt in self.kept
            and nxt.on_device
            and pos + 1 < len(order)
            and order[pos + 1] is nxt
        ):
            pos += 1
            nxt = self._next(nxt, pos)
        return nxt

    def _request_calls(self) -> dict[str, int] | None:
        """Forward calls per component in one request, following the successors from
        the request's first call back to it (None: no whole request observed yet)."""
        start = self.cycle_start
        if start is None:
            return None
        calls = {start[0]: 1}
        key = self.successor.get(start)
        for _ in range(len(self.successor)):
            if key is None:
                return None
            if key == start:
                return calls
            calls[key[0]] = calls.get(key[0], 0) + 1
            key = self.successor.get(key)
        return None

    def _next_call(self, component: str) -> StreamedBlock | None:
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

    def _wait(self, block: StreamedBlock) -> None:
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

    def _record(self, block: StreamedBlock, stream: Any) -> None:
        """``record_stream(stream)`` on every device payload of the block."""
        record_on(stream, (m for slot in block.weights.slots for m in slot.members), self.device)

    def _emit(self, event: str, block: StreamedBlock, start: float) -> None:
        if self.listeners:
            end = time.perf_counter()
            for listener in self.listeners:
                listener(event, block, start, end)

    def _prefetch(self, block: StreamedBlock) -> None:
        self._load(block, self.copy_stream)
        self.prefetched = block
        self._unused = block
        self.stats.prefetches += 1

    def _drop_prefetch(self) -> None:
        """Release the prefetched block (write-checked: it may have been written while it
        waited); the streamer forgets it only once the release succeeded."""
        block = self.prefetched
        if block is None:
            return
        if block.on_device:
            self._wait(block)
            if block not in self.kept:  # a kept block stays, prefetched or not
                self._release(block)
                if block is self._unused:
                    self.stats.wasted_prefetches += 1
                    self.stats.wasted_bytes += block.nbytes
        if block is self._unused:
            self._unused = None
        self.prefetched = None

    def _load(self, block: StreamedBlock, stream: Any) -> None:
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
                moved, arenas, _ = comp.load_slots(txn)
                comp.record_disk_sums(arenas)
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
        block.carried = False
        block.event = event
        block.on_device = True
        comp.resident = True
        if moved:
            comp._count("load", start)
            self._emit("prefetch" if stream is not None else "load", block, start)

    def _abort(self, txn: Transaction, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()  # no copy may still write what the rollback frees
        txn.rollback()

    def _changed(self, block: StreamedBlock, slots: list[Any], members: list[Member]) -> list[bool]:
        """Per member, whether its device bytes differ from its host copy: the device
        check (``ComponentWeights.changed``: each arena's sums computed on the device,
        read back in one copy, one host wait, compared with its host copy's). The host
        cannot judge a block that ran: an in-place op on ``p.data`` inside its forward or
        a hook (``m.bias.data.add_(1)``) changes neither its version counter nor its
        storage."""
        if not members:
            return []
        if not self.check_writes:  # replacements only: seen on the host, for free
            return [self._replaced(s, m) for s in slots for m in s.members]
        waited = time.perf_counter()
        changed = block.weights.changed(slots)
        self._emit("host wait", block, waited)
        return changed

    def _replaced(self, slot: Any, member: Member) -> bool:
        """Whether ``member``'s tensor is no longer its view of the arena's device
        allocation (``p.data = t`` while on the device): a host-side test, no device op."""
        arena = slot.arena
        if arena is None or arena.device_key is None:
            return False
        p = member.payload
        return not arena.covers(p, self.platform.storage_key(p), slot, member)

    def _release(self, block: StreamedBlock, known: list[bool] | None = None) -> None:
        """Write back what changed, then drop the block's device copies. A prefetched
        block's memory was recorded on the stream that ran it (``_wait``), so the caching
        allocator reuses it only after that compute. All or nothing: on failure the block
        is still on the device, every tensor in place. A copy into the block still in
        flight on the copy stream is waited on first (``_wait``: an event wait, no host
        synchronize): the write check and the write-back read its device bytes."""
        self._wait(block)
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
            changed = known if known is not None else self._changed(block, slots, members)
            mover.evict(slots, txn, changed)
        except BaseException:
            txn.rollback()
            raise
        txn.commit()  # the device copies are freed here
        block.carried = False
        block.event = None
        block.on_device = False
        comp.resident = False
        if slots:
            comp._count("evict", start)
            self._emit("release", block, start)
