"""``diffusion_offload.hooks``: the offload hooks, at their path from before the offload
core became ``diffusion_offload.core`` (kept so that code written against it keeps
importing). Defined in ``diffusion_offload.core.hooks``; the same objects."""

from __future__ import annotations

from .core.hooks import HookHandle, SequentialOffloadHook, attach_hook, get_hook, offload_component

__all__ = ["HookHandle", "SequentialOffloadHook", "attach_hook", "get_hook", "offload_component"]
