"""``LayerwiseOffloadBackend``: layer mode, block-streamed components (SPEC section 10).

Each selected component (DiT, text encoder) keeps its *trunk* on the device (embeddings,
norms, heads: everything outside its blocks) and streams its blocks through one
``BlockStreamer`` (``core/streamer.py``: the schedule, the prefetch on the copy stream, the
loads and the write-checked releases). This module holds the backend and its two hooks:
``_BlockHooks`` (a forward pre-hook and post-hook per streamed block, which call the
streamer's ``before``/``after``) and ``_StageEntry`` (outermost on every stage module's
``forward``/``decode``/``encode``, which runs each outermost call through
``BlockStreamer.call``). Unselected components stay resident; there is no mutual exclusion
between components: each streams its own blocks.

With ``device_memory_budget`` the backend keeps as many streamed blocks resident as fit
(``policy.keep_blocks``, chosen again at every request's start from the calls of the
request before: the streamer's ``kept``). A block whose forward a diffusers cache skips
(First Block Cache: the head block found the step close enough to the cached one) is
not streamed: ``_BlockHooks`` asks the cache's hook before loading (``_cache_skips``).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..blocks import check_disjoint, discover_blocks
from ..config import DiffusionOffloadConfig
from ..discovery import Component, STAGE_ROLES
from ..hooks import SequentialOffloadHook, attach_hook
from ..policy import BlockSpec, BudgetTooSmallError, keep_blocks, resolve_budget
from ..residency import ComponentWeights, WeightTable
from ..streamer import BlockStreamer, StreamedBlock
from .base import OffloadBackendBase

__all__ = ["LayerwiseOffloadBackend"]

logger = logging.getLogger(__name__)

_STREAMED_ROLES = ("dit", "text_encoder")


@functools.cache
def _skipping_hook_types() -> tuple[type, ...]:
    """The diffusers hook classes that may return a block's cached output without running
    it and say so in ``state_manager.get_state().should_compute`` (First Block Cache)."""
    try:
        from diffusers.hooks.first_block_cache import FBCBlockHook
    except ImportError:  # a diffusers without First Block Cache
        return ()
    return (FBCBlockHook,)


def _cache_skips(module: nn.Module) -> bool:
    """Whether a diffusers cache hook on block ``module`` (``enable_cache`` before or
    after ``enable``: it is asked at call time) will skip the block's body now.

    First Block Cache decides in the head block, before the others are called; a block
    it skips returns its input. Without a cache context (FBC then raises its own error)
    or any doubt, the block is loaded."""
    registry = getattr(module, "_diffusers_hook", None)  # diffusers' HookRegistry
    if registry is None:
        return False
    kinds = _skipping_hook_types()
    for hook in getattr(registry, "hooks", {}).values():
        if kinds and isinstance(hook, kinds):
            try:
                return not hook.state_manager.get_state().should_compute
            except Exception:  # noqa: BLE001 - no cache context: let the cache raise
                return False
    return False


class _BlockHooks:
    """The forward pre-hook and post-hook of one streamed block, and their removal.

    A call that a cache skips (``_cache_skips``) is reported with ``streamer.skip`` and
    never loads the block; its post-hook does nothing."""

    def __init__(self, module: nn.Module, block: StreamedBlock, streamer: BlockStreamer) -> None:
        self.module_ref = weakref.ref(module)
        self.block = block
        self.streamer_ref = weakref.ref(streamer)
        self._handles: list[Any] = []

    def install(self) -> None:
        module = self.module_ref()
        if module is None:
            return
        block, streamer_ref = self.block, self.streamer_ref
        skipped: list[bool] = []  # per call of the block in progress (nested: several)

        @torch.compiler.disable
        def pre(mod: nn.Module, args: tuple) -> None:
            streamer = streamer_ref()
            if streamer is None:
                return
            skip = _cache_skips(mod)
            skipped.append(skip)
            if skip:
                streamer.skip(block)
            else:
                streamer.before(block)

        @torch.compiler.disable
        def post(mod: nn.Module, args: tuple, output: Any) -> None:
            if not skipped:  # an earlier pre-hook raised: ours never ran for this call
                return
            skip = skipped.pop()
            streamer = streamer_ref()
            if streamer is not None and not skip:
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
            (default: each release compares the block's arena sums on the device with its
            host copy's, one small read-back and so one host wait a release; a ``.data``
            in-place write inside a forward or a hook is seen too).
            False: for pure inference, device->host traffic is exactly the pipeline's
            own, and an in-place write to a streamed weight while it is on the device is
            lost (a ``p.data = t`` replacement is still seen on the host and kept).
        component_roles, max_pinned_bytes, host_memory_budget, weights_from: as
            ``ModelLevelOffloadBackend``.
        device_memory_budget: bytes of weights that may be on the device at once
            (``"auto"``: the free device memory at enable minus max(10 % of the
            device, 1 GiB); None: no budget, only the trunks and two blocks). The
            streamed blocks that fit beyond the trunks, the unselected components, the
            ``resident_layers`` and the two largest streamed blocks stay on the device
            once loaded (``core.policy.keep_blocks``: the least H2D per request, ties
            spread through the stack), chosen at the start of every request after the
            first from the calls per component of the request before.

    Peak device memory: trunks of the selected components + resident layers + the two
    largest streamed blocks + unselected components + activations (SPEC section 10);
    with a budget, the budget + activations.

    Raises:
        TypeError, ValueError: an invalid config, ``layer_blocks``, device or
            ``device_memory_budget``; at ``enable``, ``BudgetTooSmallError`` (a
            ValueError) for a budget below the trunks + unselected components + the two
            largest streamed blocks, before anything moves.
        NotImplementedError: ``weight_transfer="allgather"`` (distributed layer offload,
            which gathers sharded blocks across ranks, is not implemented).
    """

    MODE = "layer"
    STAGE_BY_UNIT = True

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
        device_memory_budget: int | str | None = None,
        host_memory_budget: int | str | None = None,
        weights_from: str | os.PathLike[str] | None = None,
        page_cache: str = "auto",
        sleepable: bool = False,
    ) -> None:
        super().__init__(
            config, device, component_roles=component_roles, max_pinned_bytes=max_pinned_bytes,
            host_memory_budget=host_memory_budget, weights_from=weights_from,
            page_cache=page_cache, sleepable=sleepable,
        )
        if device_memory_budget != "auto":  # the bytes of "auto" are measured at enable
            resolve_budget(device_memory_budget, self.platform)
        self.device_memory_budget = device_memory_budget
        #: the budget in bytes since ``enable`` (``"auto"`` resolved), or None
        self.budget: int | None = None
        #: bytes of weights that always stay on the device since ``enable`` (trunks,
        #: resident layers, unselected components)
        self.fixed_bytes = 0
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

    @property
    def kept(self) -> dict[str, list[str]]:
        """Streamed block names the budget keeps resident now, per component."""
        if self.streamer is None:
            return {}
        kept = self.streamer.kept
        return {
            c: [b.name for b in seq if b in kept]
            for c, seq in self.streamer.sequences.items()
            if any(b in kept for b in seq)
        }

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

    def _release_streamed(self) -> None:
        if self.streamer is not None:
            self.streamer.release_all()

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
            on_device = streamer.on_device()
            extra = [
                f"{b.component}.{b.name}" for b in on_device
                if id(b) not in allowed and b not in streamer.kept
            ]
            if extra:
                out.append(
                    f"streamed blocks on the device that neither run nor are prefetched: {extra}"
                )
            if self.budget is not None:
                resident = self.fixed_bytes + sum(b.nbytes for b in on_device)
                if resident > self.budget:
                    out.append(f"{resident} bytes of weights on the device, over the budget of {self.budget}")
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
                    keep = self.resident_layers("dit")
                    if keep > len(blocks):
                        raise ValueError(
                            f"layer_options['dit'].resident_layers={keep} is larger than "
                            f"{comp.name!r}'s {len(blocks)} blocks; allowed: 0..{len(blocks)} "
                            f"({len(blocks)} keeps every block resident)"
                        )
                    blocks = blocks[keep:]
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
        budget, fixed = self._check_budget(table, named, selected)
        streamer = BlockStreamer(self.platform, self.mover, self.lock, self.prefetch, self.check_writes)

        def install(weights: dict[str, ComponentWeights], handles: list[Any]) -> None:
            for cname, entries in block_weights.items():
                streamer.sequences[cname] = [
                    StreamedBlock(cname, i, bname, w) for i, (bname, _, w) in enumerate(entries)
                ]
            for comp in components:
                hook = None
                if comp.role in STAGE_ROLES:
                    hook = SequentialOffloadHook(weights[comp.name], (), (), self.lock)
                handles.append(attach_hook(comp.module, hook, comp.name, child_hooks=False))
                if comp.role in STAGE_ROLES:
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
            if budget is not None:
                streamer.choose_kept = _chooser(streamer, budget - fixed)
            self.streamer = streamer

        self._transact_enable(table, named, selected, install)
        self.budget, self.fixed_bytes = budget, fixed

    def _check_budget(
        self,
        table: WeightTable,
        named: dict[str, list[tuple[str, torch.Tensor]]],
        selected: dict[str, bool],
    ) -> tuple[int | None, int]:
        """``(budget in bytes or None, bytes that always stay on the device)``, before
        anything is adopted, pinned or moved.

        Raises:
            BudgetTooSmallError: the budget (``"auto"`` resolved) is below those bytes
                plus the two largest streamed blocks (the message names them).
            ValueError: a meta tensor or a tensor on a foreign device (named).
        """
        table.check_tensors(named)
        plan = table.plan(named, selected)
        fixed = sum(n for _, n, evictable in plan if not evictable)
        if self.device_memory_budget is None:
            return None, fixed
        sizes: dict[str, int] = {}
        for owners, n, evictable in plan:
            if evictable:
                for owner in owners:
                    sizes[owner] = sizes.get(owner, 0) + n
        on_device = self._bytes_on_device(named)
        budget = resolve_budget(self.device_memory_budget, self.platform, on_device)
        assert budget is not None
        largest = sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:2]
        buffer = sum(n for _, n in largest)
        if budget < fixed + buffer:
            raise BudgetTooSmallError(
                self.device_memory_budget, budget, fixed + buffer, fixed, buffer,
                tuple(name for name, _ in largest), layer=True,
            )
        return budget, fixed

    def _at_rest_on_host(self, weights: ComponentWeights) -> bool:
        """Layer mode: the streamed blocks rest on the host, everything else on the device."""
        return weights.selected

    def __repr__(self) -> str:
        state = "enabled" if self._enabled else "disabled"
        return f"LayerwiseOffloadBackend({self.config.to_json()}, {self.device}, {state})"


def _chooser(streamer: BlockStreamer, room: int) -> Callable[[dict[str, int]], set[StreamedBlock]]:
    """``streamer.choose_kept`` for a budget leaving ``room`` bytes beside the weights
    that always stay on the device: ``keep_blocks`` over every streamed block."""

    def choose(calls: dict[str, int]) -> set[StreamedBlock]:
        blocks = [b for seq in streamer.sequences.values() for b in seq]
        specs: list[BlockSpec] = [(b.component, b.index, b.nbytes) for b in blocks]
        return {blocks[i] for i in keep_blocks(specs, calls, room)}

    return choose
