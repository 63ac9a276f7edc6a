"""Clearing the method caches that keep a pipeline's device tensors alive.

Used by the engine when it closes a pipeline, by the planner after measuring on meta
modules and by the compatibility matrix after each run; it reads only the pipeline's
``components`` and their classes.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clear_method_caches"]


def clear_method_caches(pipeline: Any) -> None:
    """Clear ``functools.lru_cache`` methods of the pipeline's module classes.

    Some models memoize device tensors in a method cache keyed on ``(self, device)``
    (diffusers' ``QwenEmbedRope``, through ``lru_cache_unless_export``, which keeps the
    ``lru_cache`` in its wrapper's closure); such a cache keeps the module and its device
    tensors alive after the pipeline is dropped, so ``close`` clears it. The caches are
    per class: other live engines with the same classes just recompute their entries.
    """

    def caches(func: Any) -> list[Any]:
        is_cache = callable(getattr(func, "cache_clear", None)) and hasattr(func, "cache_info")
        found = [func] if is_cache else []
        for cell in getattr(func, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # empty cell
                continue
            if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
                found.append(value)
        return found

    seen: set[type] = set()
    for component in getattr(pipeline, "components", {}).values():
        if not isinstance(component, torch.nn.Module):
            continue
        for module in component.modules():
            for cls in type(module).__mro__:
                if cls in seen or cls.__module__.startswith(("torch.", "builtins")):
                    continue
                seen.add(cls)
                for attr in vars(cls).values():
                    for cache in caches(getattr(attr, "__func__", attr)):  # (static/class methods)
                        cache.cache_clear()
