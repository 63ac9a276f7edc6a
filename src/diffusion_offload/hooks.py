"""``SequentialOffloadHook``: the pre-forward hook of model-level offload.

A hook wraps its module's ``forward`` as an instance attribute, so it fires for
``module(...)`` and for direct ``module.forward(...)`` calls, runs after torch forward
pre-hooks and before the original forward, and composes with other libraries' forward
wrappers installed before or after it. Removal restores the previous ``forward`` when
ours is still the outermost wrapper; when another wrapper sits on ours, ours becomes an
inert pass-through instead (unwrapping it would drop the other library's wrapper).

The hook only calls into ``ComponentWeights``: evict the exclusion set, load its own
component, move tensor arguments to the device, synchronize if it moved anything. When
everything is in place it does no transfer, no synchronize and no walk over parameters.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .platform import same_device
from .transfer import ComponentWeights

__all__ = ["HookHandle", "SequentialOffloadHook", "attach_hook", "get_hook", "offload_component"]


class SequentialOffloadHook:
    """Mutual exclusion for one execution-stage module.

    Args:
        component: the module's weights.
        exclusion: selected components to evict before this one runs (for a DiT: the
            selected encoders and the other selected DiTs; for an encoder: the selected
            DiTs; for a VAE: none).
        companions: components of the same group loaded together with this one (the
            other selected encoders of an encoder: a pipeline's text encoders run back
            to back, so the encoder stage is one group).

    ``pre_forward`` evicts before it loads, so the device never holds two groups.
    """

    def __init__(
        self,
        component: ComponentWeights,
        exclusion: Sequence[ComponentWeights],
        companions: Sequence[ComponentWeights] = (),
    ) -> None:
        self.component = component
        self.exclusion = tuple(c for c in exclusion if c is not component)
        self.group = (component, *(c for c in companions if c is not component))
        self.context_depth = 0  # open ``offload_component`` contexts of this module
        self.pre_forward = torch.compiler.disable(self.pre_forward)  # type: ignore[method-assign]
        self.device = component.mover.device
        self._platform = component.mover.platform
        self._non_blocking = component.mover.pin

    def activate(self) -> bool:
        """Evict the exclusion set, then load the component (which synchronizes).

        Returns True if any tensor moved. Parameterless components move nothing.
        """
        moved = False
        for other in self.exclusion:
            if other.resident:
                moved = other.evict() or moved
        for member in self.group:
            if not member.resident:
                moved = member.load() or moved
        return moved

    def _to_device(self, value: Any, moved: list[bool]) -> Any:
        if isinstance(value, torch.Tensor):
            if same_device(value.device, self.device):
                return value
            moved[0] = True
            return value.to(self.device, non_blocking=self._non_blocking)
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            items = [self._to_device(v, moved) for v in value]
            return type(value)(items)
        if isinstance(value, dict):
            return {k: self._to_device(v, moved) for k, v in value.items()}
        return value

    def pre_forward(
        self, module: nn.Module, args: tuple, kwargs: dict
    ) -> tuple[tuple, dict]:
        """Make the component resident and put tensor args/kwargs on the device.

        Weight loads synchronize inside ``ComponentWeights.load``; moved inputs are
        synchronized here. Nothing moved: no synchronize. Compiler-disabled: the
        instance's ``pre_forward`` is wrapped by ``torch.compiler.disable`` in
        ``__init__`` (there, not at import, so importing the package does not import
        ``torch._dynamo``).
        """
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


class HookHandle:
    """One installed hook: the module, our wrapper and what ``forward`` was before it."""

    def __init__(self, module: nn.Module, hook: SequentialOffloadHook) -> None:
        self.module_ref = weakref.ref(module)
        self.hook = hook
        self.active = True
        self.had_instance_forward = "forward" in module.__dict__
        self.previous: Callable[..., Any] | None = module.__dict__.get("forward")
        original = module.forward
        handle = self

        @functools.wraps(original)
        def offload_forward(*args: Any, **kwargs: Any) -> Any:
            if handle.active:
                args, kwargs = hook.pre_forward(module, args, kwargs)
            return original(*args, **kwargs)

        self.wrapper = offload_forward

    def remove(self) -> None:
        """Uninstall: restore ``forward`` if ours is outermost, else become a pass-through."""
        module = self.module_ref()
        self.active = False
        if module is None:
            return
        if module.__dict__.get("forward") is self.wrapper:
            if self.had_instance_forward:
                module.forward = self.previous
            else:
                del module.__dict__["forward"]
        if _REGISTRY.get(module) is self:
            del _REGISTRY[module]


_REGISTRY: "weakref.WeakKeyDictionary[nn.Module, HookHandle]" = weakref.WeakKeyDictionary()


def get_hook(module: nn.Module) -> SequentialOffloadHook | None:
    """The active offload hook of ``module``, or None."""
    handle = _REGISTRY.get(module)
    return handle.hook if handle is not None and handle.active else None


def attach_hook(module: nn.Module, hook: SequentialOffloadHook) -> HookHandle:
    """Install ``hook`` on ``module`` and return its handle.

    Raises:
        RuntimeError: ``module`` already has an offload hook (one per module, ever).
    """
    if get_hook(module) is not None:
        raise RuntimeError(
            f"{type(module).__name__} already has an offload hook; disable the backend that "
            "installed it first (one offload hook per module)"
        )
    handle = HookHandle(module, hook)
    module.forward = handle.wrapper
    _REGISTRY[module] = handle
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
    hook.activate()
    hook.context_depth += 1
    try:
        yield module
    finally:
        hook.context_depth -= 1
        if hook.context_depth == 0:
            hook.component.evict()
