"""Foreign placement hooks: components another library already places are refused.

Two libraries attach placement hooks that move weights or inputs on their own, and fight
an offloader that moves the same weights:

* accelerate's ``_hf_hook`` (``AlignDevicesHook``, ``CpuOffload``, a ``SequentialHook``
  of them), left on a module by ``from_pretrained(device_map=...)``,
  ``accelerate.dispatch_model``, ``enable_model_cpu_offload`` and
  ``enable_sequential_cpu_offload``;
* diffusers' group offloading, registered in a module's ``_diffusers_hook`` registry
  (``diffusers.hooks.HookRegistry``) under the names in ``GROUP_OFFLOAD_HOOKS``
  (``enable_group_offload``, ``apply_group_offloading``).

diffusers refuses to combine these with its own offload (``enable_model_cpu_offload``
after a device map: "call reset_device_map() first"); ``check_foreign_hooks`` does the
same at ``enable``, before anything moves. Other hooks in the same registry (layerwise
casting, the caches: First Block Cache, FasterCache, PAB, TaylorSeer...) run inside a
module's forward without placing weights and are accepted.

Sources: accelerate 1.15 ``accelerate/hooks.py`` (``add_hook_to_module`` sets
``module._hf_hook``; ``remove_hook_from_module(module, recurse=True)`` removes them);
diffusers 0.42 ``hooks/group_offloading.py`` (``_GROUP_OFFLOADING``,
``_LAZY_PREFETCH_GROUP_OFFLOADING``, ``_LAYER_EXECUTION_TRACKER``), ``pipelines/
pipeline_utils.py`` (``remove_all_hooks``, ``reset_device_map``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from .discovery import Component

__all__ = ["GROUP_OFFLOAD_HOOKS", "ForeignHookError", "check_foreign_hooks", "foreign_hooks"]

#: names diffusers' group offloading registers in a module's ``_diffusers_hook`` registry
GROUP_OFFLOAD_HOOKS: tuple[str, ...] = (
    "group_offloading",
    "lazy_prefetch_group_offloading",
    "layer_execution_tracker",
)


class ForeignHookError(ValueError):
    """A component carries another library's placement hooks (raised by ``enable``
    before anything moves)."""


def foreign_hooks(module: nn.Module) -> tuple[list[str], list[str]]:
    """The placement hooks on ``module`` and its submodules.

    Returns:
        ``(accelerate, group_offload)``: the dotted paths (``""`` for ``module`` itself)
        of the submodules with an accelerate ``_hf_hook``, and ``"path: hook name"`` for
        each diffusers group-offload hook (``GROUP_OFFLOAD_HOOKS``) registered in a
        ``_diffusers_hook`` registry. Hooks of other kinds are not listed.
    """
    accelerate: list[str] = []
    group: list[str] = []
    for path, sub in module.named_modules(remove_duplicate=False):
        if getattr(sub, "_hf_hook", None) is not None:
            accelerate.append(path)
        registry = getattr(sub, "_diffusers_hook", None)
        hooks = getattr(registry, "hooks", None) or {}
        group.extend(f"{path}: {name}" for name in hooks if name in GROUP_OFFLOAD_HOOKS)
    return accelerate, group


def _where(paths: Iterable[str], limit: int = 3) -> str:
    shown = [p or "<the component itself>" for p in paths]
    more = f" and {len(shown) - limit} more" if len(shown) > limit else ""
    return ", ".join(shown[:limit]) + more


def _accelerate_fix(pipeline: Any, name: str) -> str:
    ways = []
    if getattr(pipeline, "hf_device_map", None) is not None and callable(
        getattr(pipeline, "reset_device_map", None)
    ):
        ways.append("pipe.reset_device_map() (the pipeline was loaded with device_map=...)")
    if callable(getattr(pipeline, "remove_all_hooks", None)):
        ways.append(
            "pipe.remove_all_hooks() (after enable_model_cpu_offload / enable_sequential_cpu_offload)"
        )
    ways.append(f"accelerate.hooks.remove_hook_from_module(pipe.{name}, recurse=True)")
    return "; or ".join(ways)


def _group_fix(module: nn.Module, name: str) -> str:
    if callable(getattr(module, "disable_group_offload", None)):
        return f"pipe.{name}.disable_group_offload()"
    # diffusers 0.42 has no public way to undo enable_group_offload
    return (
        f"load pipe.{name} again without enable_group_offload (diffusers has no "
        "disable_group_offload), or remove the hooks with "
        "diffusers.hooks.HookRegistry.check_if_exists_or_initialize(pipe."
        f"{name}).remove_hook(n, recurse=True) for n in {list(GROUP_OFFLOAD_HOOKS)}"
    )


def check_foreign_hooks(components: Iterable[Component], pipeline: Any) -> None:
    """Refuse components that another library's placement hooks already manage.

    Layerwise casting and cache hooks in diffusers' registry are accepted.

    Args:
        components: the discovered components (every role: a resident one is placed too).
        pipeline: the pipeline they belong to (asked which removal methods it has).

    Raises:
        ForeignHookError (a ValueError): naming the component, where its hooks are and
            how to remove them with the installed diffusers and accelerate.
    """
    for comp in components:
        accelerate, group = foreign_hooks(comp.module)
        if accelerate:
            raise ForeignHookError(
                f"component {comp.name!r} ({type(comp.module).__name__}) carries accelerate "
                f"placement hooks (_hf_hook, from device_map=..., dispatch_model or diffusers' "
                f"enable_model_cpu_offload / enable_sequential_cpu_offload) on "
                f"{_where(accelerate)}; they move weights and inputs themselves and would "
                f"fight the offload. Remove them first: {_accelerate_fix(pipeline, comp.name)}"
            )
        if group:
            raise ForeignHookError(
                f"component {comp.name!r} ({type(comp.module).__name__}) has diffusers group "
                f"offloading hooks ({_where(group)}); group offloading and this offload "
                f"cannot both place its weights. Remove them first: {_group_fix(comp.module, comp.name)}"
            )
