"""Hooks of model-level offload: ``SequentialOffloadHook`` and what guards a component.

A hook wraps its module's ``forward`` (and a VAE's ``decode`` and ``encode``, which
diffusers calls directly) as an instance attribute, so it fires for ``module(...)``, for
direct ``module.forward(...)`` calls and for ``vae.decode(...)``, runs after torch forward
pre-hooks and before the original forward, and composes with other libraries' forward
wrappers installed before or after it. Removal restores the previous ``forward`` when
ours is still the outermost wrapper; when another wrapper sits on ours, ours becomes an
inert pass-through instead (unwrapping it would drop the other library's wrapper).

The hook only calls into ``ComponentWeights``: evict the exclusion set, load its own
group, move tensor arguments to the device, synchronize if it moved anything. When
everything is in place it does no transfer, no synchronize and no walk over parameters.

Beside the ``forward`` wrapper, a ``HookHandle`` installs:

* a forward pre-hook on every submodule of a selected component, so a direct call into
  a child (``pipe.text_encoder.encoder(...)``) loads the component first (O(1) when it
  is resident), and a guard on each submodule's ``_apply``, so ``block.to(...)`` cannot
  move part of a component to the other side (dtype conversions such as diffusers'
  layerwise casting pass);
* a guard on the component's ``Module._apply`` (what ``module.to(...)``, ``.cuda()``,
  ``.half()`` and diffusers' ``pipe.to(...)`` call): a move to the offload device keeps
  the offload placement (nothing moves), a move elsewhere or a dtype change raises a
  RuntimeError naming ``disable()`` before anything changes.

Nothing installed on a module holds the module strongly: the wrappers reach it through
a weak reference, so a deleted pipeline frees its memory without ``disable()``. The
module keeps its handle (and so its hook) alive, so offload keeps working when the
caller drops the backend object.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .platform import same_device
from .residency import ComponentWeights
from .transfer import Transaction

if TYPE_CHECKING:
    from .policy import MemoryPolicy

__all__ = ["HookHandle", "SequentialOffloadHook", "attach_hook", "get_hook", "offload_component"]


class SequentialOffloadHook:
    """Mutual exclusion for one execution-stage module.

    Args:
        component: the module's weights.
        exclusion: selected components to evict before this one runs (for a DiT: the
            selected encoders and the other selected DiTs; for an encoder or a VAE: the
            selected DiTs).
        companions: components of the same group loaded together with this one (the
            other selected encoders of an encoder: a pipeline's text encoders run back
            to back, so the encoder stage is one group).
        lock: the backend's lock; activations from several threads are serialized.
        policy: the backend's ``MemoryPolicy`` (budget, order, prefetch, OOM retry), or
            None: the strict rule, no retry.

    ``pre_forward`` evicts before it loads, so under the strict rule the device never
    holds two groups. With a budget the policy decides what to evict (see ``policy``).
    """

    def __init__(
        self,
        component: ComponentWeights,
        exclusion: Sequence[ComponentWeights],
        companions: Sequence[ComponentWeights] = (),
        lock: threading.RLock | None = None,
        policy: "MemoryPolicy | None" = None,
    ) -> None:
        self.component = component
        self.exclusion = tuple(c for c in exclusion if c is not component)
        self.group = (component, *(c for c in companions if c is not component))
        self.stage = tuple(sorted(c.name for c in self.group))
        self.policy = policy
        self.lock = lock if lock is not None else threading.RLock()
        self.context_depth = 0  # open ``offload_component`` contexts of this module
        self.active = True  # False once its handle is removed (``disable``)
        self.pre_forward = torch.compiler.disable(self.pre_forward)  # type: ignore[method-assign]
        self.activate = torch.compiler.disable(self.activate)  # type: ignore[method-assign]
        self.device = component.mover.device
        self._platform = component.mover.platform
        self._non_blocking = component.mover.pin

    @property
    def budgeted(self) -> bool:
        """A memory budget governs this hook (not the strict rule)."""
        return self.policy is not None and not self.policy.strict

    @property
    def ready(self) -> bool:
        """Nothing to do before the module runs: its group is resident and unchanged and,
        under the strict rule, no excluded component is resident (O(group + exclusion),
        no tensor walk)."""
        if not all(c.ready for c in self.group):
            return False
        if self.budgeted:
            policy = self.policy
            return not (self.component.role == "vae" and policy.decode_needs_room and any(  # type: ignore[union-attr]
                c.selected and c.resident for c in policy.components.values()  # type: ignore[union-attr]
            ))
        return not any(c.resident or c.generation != c.synced for c in self.exclusion)

    def _take_structural_changes(self) -> list[ComponentWeights]:
        """Adopt the group's structural changes (a LoRA) before the policy makes room, so
        the room made is the room its load needs and a grown group raises the budget in
        force instead of overrunning it (see ``policy``). Returns the members synced: their
        new tensors are still on the host, so they load even if resident."""
        grown = []
        for member in self.group:
            if member.generation != member.synced:
                txn = Transaction()
                try:
                    member.sync(txn)
                except BaseException:
                    txn.rollback()
                    raise
                txn.commit()
                grown.append(member)
        return grown

    def _evict_for_budget(self) -> bool:
        policy = self.policy
        assert policy is not None
        if self.component.role == "vae":
            # after a decode ran out of memory beside them, evict what its retry evicted
            targets = [c for c in policy.components.values() if c.selected] if policy.decode_needs_room else []
        else:
            policy.refresh_budget()
            targets = policy.victims(self.group, list(policy.components.values()))
        moved = False
        for other in targets:
            if other.resident or other.generation != other.synced:
                moved = bool(other.evict()) or moved
        return moved

    def activate(self) -> bool:
        """Make room (strict rule: evict the exclusion set; budget: the policy's victims),
        then load the group (which synchronizes; a member prefetched on the copy stream
        is completed instead: the current stream waits on its event), then, with a
        budget, prefetch the next stage.

        Returns True if any tensor moved. Parameterless components move nothing. Each
        eviction and load is all-or-nothing; an interrupted activation leaves every
        component either fully resident or fully on the host.
        """
        with self.lock:
            moved = False
            policy = self.policy
            grown: list[ComponentWeights] = []
            if self.budgeted:
                if self.component.role != "vae":
                    grown = self._take_structural_changes()
                moved = self._evict_for_budget()
            else:
                for other in self.exclusion:
                    if other.resident or other.generation != other.synced:
                        moved = bool(other.evict()) or moved
            for member in self.group:
                # whatever evicted a prefetched member, its own ``pending`` says whether
                # a load is in flight: never a stale record that skips the load
                member.finish_pending()
                if not member.ready or member in grown:
                    moved = bool(member.load()) or moved
            if self.budgeted:
                policy.prefetch_next(self.group, policy.group_of)  # type: ignore[union-attr]
            return moved

    def order_pending(self) -> None:
        """Order the current stream after the policy's prefetches in flight (no host
        wait; see ``MemoryPolicy.order_pending``). O(1) when there are none."""
        policy = self.policy
        if policy is not None and policy._unordered:
            with self.lock:
                policy.order_pending()

    def settle(self) -> None:
        """With a budget, evict until the resident weights are within it (the end of the
        outermost offloaded call: a stage bigger than the budget leaves the device as soon
        as it is done; see ``MemoryPolicy.settle``). O(slots) when nothing is over."""
        policy = self.policy
        if policy is not None and not policy.strict:
            with self.lock:
                policy.settle()

    def recover_from_oom(self) -> list[str]:
        """Evict every selected component outside this hook's group and empty the device
        cache (the first OOM of a stage); returns the names evicted."""
        with self.lock:
            names = {c.name for c in self.group}
            evicted = []
            comps = self.policy.components.values() if self.policy is not None else self.exclusion
            for comp in comps:
                if comp.selected and comp.name not in names and comp.resident:
                    comp.evict()
                    evicted.append(comp.name)
            if self.policy is not None:
                self.policy.retries += 1
                self.policy.tight.add(self.stage)
                if self.component.role == "vae":
                    self.policy.decode_needs_room = True
            self._platform.empty_cache()
            return evicted

    def _to_device(self, value: Any, moved: list[bool]) -> Any:
        if isinstance(value, torch.Tensor):
            if same_device(value.device, self.device):
                return value
            if self._non_blocking and value.is_pinned():
                moved[0] = True  # an asynchronous copy: the caller may reuse the buffer
            return value.to(self.device, non_blocking=self._non_blocking)
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            items = [self._to_device(v, moved) for v in value]
            return type(value)(items)
        if isinstance(value, dict):
            return {k: self._to_device(v, moved) for k, v in value.items()}
        return value

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Make the group resident and put tensor args/kwargs on the device.

        Weight loads are ordered by the stream (no host wait). Inputs in pinned host
        memory, whose copy is asynchronous, are synchronized here, so the caller may reuse
        them after the call; pageable inputs are copied synchronously (no synchronize). Compiler-disabled: the
        instance's ``pre_forward`` is wrapped by ``torch.compiler.disable`` in
        ``__init__`` (there, not at import, so importing the package does not import
        ``torch._dynamo``).
        """
        policy = self.policy
        if policy is not None and policy.observe(self.stage) and self.budgeted:
            self.activate()  # a new stage: the policy may prefetch the next one
        elif not self.ready:
            self.activate()
        moved = [False]
        if args:
            args = tuple(self._to_device(a, moved) for a in args)
        if kwargs:
            kwargs = {k: self._to_device(v, moved) for k, v in kwargs.items()}
        if moved[0]:
            self._platform.synchronize()
        return args, kwargs

    def __repr__(self) -> str:
        names = [c.name for c in self.exclusion]
        return f"SequentialOffloadHook({self.component.name!r}, evicts={names})"


def _probe_apply(fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False), torch.no_grad():
        return fn(torch.zeros(0, dtype=dtype, device=device))


class HookHandle:
    """Everything installed on one component module, and its removal.

    Args:
        module: the component's root module.
        hook: its offload hook, or None for a component that only gets the ``_apply``
            guard (resident components with no stage).
        name: the component's name, for messages.
        child_hooks: also hook every submodule (selected components), so calls below
            the root load the component.
    """

    def __init__(
        self,
        module: nn.Module,
        hook: SequentialOffloadHook | None,
        name: str,
        child_hooks: bool,
    ) -> None:
        self.module_ref = weakref.ref(module)
        self.hook = hook
        self.name = name
        self.active = True
        self._saved: dict[str, Any] = {}
        self._child_handles: list[torch.utils.hooks.RemovableHandle] = []
        self._hooked_children: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._guarded_children: list[weakref.ref[nn.Module]] = []
        self._child_hooks = child_hooks
        self.apply_guard = self._make_apply_guard()
        # the entry points that run the module: forward, and a VAE's decode/encode
        # (diffusers calls ``vae.decode(...)``, not ``vae(...)``)
        self.wrappers: dict[str, Callable[..., Any]] = {}
        if hook is not None:
            names = ["forward"]
            if hook.component.role == "vae":
                names += [n for n in ("decode", "encode") if callable(getattr(type(module), n, None))]
            for name in names:
                self.wrappers[name] = self._make_entry(module, hook, name)

    # -- forward ----------------------------------------------------------------------

    def _make_entry(
        self, module: nn.Module, hook: SequentialOffloadHook, name: str
    ) -> Callable[..., Any]:
        module_ref = self.module_ref
        previous = module.__dict__.get(name)  # another library's wrapper, if any
        unbound = getattr(type(module), name)
        handle = self  # the module keeps its handle alive; the handle holds it weakly

        def run(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
            if handle.active:
                args, kwargs = hook.pre_forward(mod, args, kwargs)
            if previous is not None:
                return previous(*args, **kwargs)
            return unbound(mod, *args, **kwargs)

        def offload_entry(*args: Any, **kwargs: Any) -> Any:
            mod = module_ref()
            if mod is None:
                raise ReferenceError("the offloaded module was deleted")
            if not handle.active or hook.policy is None:
                return run(mod, args, kwargs)
            _CALLS.depth = getattr(_CALLS, "depth", 0) + 1
            try:
                return guarded(mod, args, kwargs)
            finally:
                _CALLS.depth -= 1
                if _CALLS.depth == 0:
                    # the outermost offloaded call ends: what runs next (the pipeline's
                    # read of the output, the caller's code between requests) is ordered
                    # after the copies a prefetch left in flight; they overlapped this
                    # call's work. Then, with a budget, the weights go back within it
                    hook.order_pending()
                    hook.settle()

        def guarded(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
            try:
                return run(mod, args, kwargs)
            except torch.OutOfMemoryError:
                evicted = hook.recover_from_oom()
            try:
                return run(mod, args, kwargs)
            except torch.OutOfMemoryError as exc:
                from .policy import StageOutOfMemoryError

                policy = hook.policy
                budget = "none (strict rule)" if policy.budget is None else f"{policy.budget} bytes"
                raise StageOutOfMemoryError(
                    f"stage {handle.name!r} ({name}) ran out of device memory twice: after the "
                    f"first out-of-memory error it evicted {evicted or 'nothing'} and emptied "
                    f"the cache, then ran out again with {policy.resident_bytes()} bytes of "
                    f"weights resident (device_memory_budget: {budget}); use a smaller "
                    f"shape, a lower budget or more offload (mode='layer'): {exc}"
                ) from exc

        offload_entry.__wrapped__ = unbound  # type: ignore[attr-defined]
        offload_entry.__doc__ = unbound.__doc__
        offload_entry.__name__ = name
        return offload_entry

    # -- children ---------------------------------------------------------------------

    def hook_children(self) -> None:
        """Give every submodule not yet hooked a pre-hook that loads the component."""
        module = self.module_ref()
        if module is None or self.hook is None or not self._child_hooks:
            return
        hook = self.hook

        component = hook.component

        def load_component(mod: nn.Module, args: tuple) -> None:
            # O(1) on every submodule call: a resident component has no excluded
            # component resident (the root's hook evicted them)
            if not component.ready:
                hook.activate()
                if getattr(_CALLS, "depth", 0) == 0:
                    hook.order_pending()  # a direct call into the child: no outer call ends

        for sub in module.modules():
            if sub is module or sub in self._hooked_children:
                continue
            self._hooked_children.add(sub)
            self._child_handles.append(sub.register_forward_pre_hook(load_component))
            if "_apply" not in sub.__dict__:
                sub.__dict__["_apply"] = self._make_child_apply_guard(sub)
                self._guarded_children.append(weakref.ref(sub))

    def _make_child_apply_guard(self, sub: nn.Module) -> Callable[..., nn.Module]:
        """``_apply`` of a submodule: conversions that keep the device (layerwise casting's
        dtype changes) and moves to the side the component is on pass; a move to the
        other side would split the component, and is refused naming ``disable()``."""
        sub_ref = weakref.ref(sub)
        handle = self

        def child_apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
            mod = sub_ref()
            if mod is None:
                raise ReferenceError("the offloaded module was deleted")
            hook = handle.hook
            if handle.active and hook is not None:
                device = hook.device
                on_host = _probe_apply(fn, torch.float32, torch.device("cpu"))
                on_device = _probe_apply(fn, torch.float32, device)
                keeps = on_host.device.type == "cpu" and same_device(on_device.device, device)
                side = device if hook.component.resident else torch.device("cpu")
                if not keeps and not same_device(on_host.device, side):
                    raise RuntimeError(
                        f"a submodule of component {handle.name!r} (managed by model-level "
                        f"offload, now on {side}) cannot be moved to {on_host.device} while "
                        "offload is enabled; call backend.disable() first"
                    )
            return type(mod)._apply(mod, fn, recurse)

        return child_apply

    # -- .to() / _apply ---------------------------------------------------------------

    def _make_apply_guard(self) -> Callable[..., nn.Module]:
        module_ref = self.module_ref
        handle = self

        def offload_apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
            mod = module_ref()
            if mod is None:
                raise ReferenceError("the offloaded module was deleted")
            if not handle.active or handle.hook is None:
                return type(mod)._apply(mod, fn, recurse)
            device = handle.hook.device
            dtype = next(
                (t.dtype for t in mod.parameters() if t.is_floating_point()), torch.float32
            )
            on_host = _probe_apply(fn, dtype, torch.device("cpu"))
            on_device = _probe_apply(fn, dtype, device)
            if on_host.dtype != dtype or on_device.dtype != dtype:
                raise RuntimeError(
                    f"component {handle.name!r} is managed by model-level offload: a dtype "
                    f"change ({dtype} -> {on_host.dtype}) is not allowed while offload is "
                    "enabled; call backend.disable() first, convert, then enable again"
                )
            if on_host.device.type == "cpu" and same_device(on_device.device, device):
                return type(mod)._apply(mod, fn, recurse)  # keeps device and dtype
            if same_device(on_host.device, device):
                return mod  # a move to the offload device: offload places the weights
            if all(same_device(t.device, on_host.device) for t in mod.parameters()):
                # ``m.to(m.device)`` (diffusers after loading a text encoder's LoRA) on a
                # component evicted there: nothing to move, the placement stays
                return mod
            raise RuntimeError(
                f"component {handle.name!r} is managed by model-level offload on {device}: "
                f"moving it to {on_host.device} is not allowed while offload is enabled; "
                "call backend.disable() first"
            )

        return offload_apply

    # -- install / remove -------------------------------------------------------------

    def install(self) -> None:
        """Put the wrappers on the module (forward, ``_apply``) and hook the children.

        Idempotent over a ``remove`` that stopped part-way: wrappers still in place keep
        what they replaced, the component listener is added once."""
        module = self.module_ref()
        assert module is not None
        for attr, value in (*self.wrappers.items(), ("_apply", self.apply_guard)):
            current = module.__dict__.get(attr)
            if current is not value:  # (still ours after an interrupted ``remove``: keep what it saved)
                self._saved[attr] = current
            module.__dict__[attr] = value
        self.hook_children()
        if self.hook is not None:
            self.hook.active = True
            if self._on_component not in self.hook.component.listeners:
                self.hook.component.listeners.append(self._on_component)
        _REGISTRY[module] = weakref.ref(self)

    def reinstall(self) -> None:
        """Install again after ``remove`` (a rolled-back ``disable``)."""
        self.active = True
        if self.module_ref() is not None:
            self.install()

    def _on_component(self, event: str, component: ComponentWeights, seconds: float) -> None:
        if event == "sync":  # submodules added since: they need the child pre-hook too
            self.hook_children()

    def remove(self) -> None:
        """Uninstall: restore each wrapper if ours is outermost, else become a pass-through."""
        module = self.module_ref()
        self.active = False
        if self.hook is not None:
            self.hook.active = False
            listeners = self.hook.component.listeners
            if self._on_component in listeners:
                listeners.remove(self._on_component)
        while self._child_handles:
            self._child_handles.pop().remove()
        while self._guarded_children:
            sub = self._guarded_children.pop()()
            if sub is not None:
                sub.__dict__.pop("_apply", None)
        self._hooked_children = weakref.WeakSet()
        if module is None:
            return
        for attr, previous in self._saved.items():
            ours = self.wrappers.get(attr, self.apply_guard)
            if module.__dict__.get(attr) is ours:
                if previous is not None:
                    module.__dict__[attr] = previous
                else:
                    del module.__dict__[attr]
        self._saved.clear()
        ref = _REGISTRY.get(module)
        if ref is not None and ref() is self:
            del _REGISTRY[module]


#: per thread: ``depth``, the offloaded entry-point calls (forward, decode, encode) open
_CALLS = threading.local()

_REGISTRY: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[HookHandle]]" = weakref.WeakKeyDictionary()


def get_handle(module: nn.Module) -> HookHandle | None:
    """The active handle installed on ``module``, or None."""
    ref = _REGISTRY.get(module)
    handle = ref() if ref is not None else None
    return handle if handle is not None and handle.active else None


def get_hook(module: nn.Module) -> SequentialOffloadHook | None:
    """The active offload hook of ``module``, or None."""
    handle = get_handle(module)
    return handle.hook if handle is not None else None


def attach_hook(
    module: nn.Module,
    hook: SequentialOffloadHook | None,
    name: str = "",
    child_hooks: bool = False,
) -> HookHandle:
    """Install ``hook`` (and the ``_apply`` guard) on ``module`` and return its handle.

    The caller keeps the handle alive (the module's registry entry is weak).

    Raises:
        RuntimeError: ``module`` already has an offload handle (one per module, ever).
    """
    if get_handle(module) is not None:
        raise RuntimeError(
            f"{type(module).__name__} already has an offload hook; disable the backend that "
            "installed it first (one offload hook per module)"
        )
    handle = HookHandle(module, hook, name or type(module).__name__, child_hooks)
    handle.install()
    return handle


@contextmanager
def offload_component(module: nn.Module) -> Iterator[nn.Module]:
    """Run a non-``forward`` entry point (``vae.decode``, ``encode``...) under offload.

    Entering runs the module's hook (evict its exclusion set, load it, synchronize);
    leaving evicts the module if it is selected for offload, also when the body raises.
    Nested contexts of the same module evict only when the outermost one exits. Entering
    a context of a mutually exclusive component inside another evicts the outer one (the
    exclusion rule); it is loaded again by its next forward or context.

    Raises:
        RuntimeError: ``module`` has no offload hook (enable a backend first).
    """
    hook = get_hook(module)
    if hook is None:
        raise RuntimeError(
            f"offload_component: {type(module).__name__} has no offload hook; call "
            "ModelLevelOffloadBackend(...).enable(pipeline) on its pipeline first"
        )
    with hook.lock:
        hook.activate()
        hook.context_depth += 1
    try:
        yield module
    finally:
        with hook.lock:
            hook.context_depth -= 1
            if hook.context_depth == 0 and hook.active:  # disable() moves nothing
                hook.component.evict()
            if getattr(_CALLS, "depth", 0) == 0:
                hook.order_pending()
