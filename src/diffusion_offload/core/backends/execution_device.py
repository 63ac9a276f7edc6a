"""Where a diffusers pipeline whose components are offloaded computes (issue 38 item 8).

diffusers pipelines build their intermediates (token ids, latents, noise, timesteps) on
``pipeline._execution_device``. Without accelerate's hooks that is ``pipeline.device``:
the device of the pipeline's first module that is not on the CPU, else of its first
module. It reads where the modules sit *now*. Under offload a pipeline can have every
one of its modules on the host between two requests:

* the sub-pipelines that diffusers' combined pipelines nest and that share their
  components (Kandinsky 2.1 / 2.2 ``...CombinedPipeline``'s ``prior_pipe``,
  ``StableCascadeCombinedPipeline``'s ``prior_pipe``): a prior pipeline holds a prior, a
  text encoder and an image encoder, and no VAE that stays resident;
* any pipeline all of whose modules are selected (the legacy switch offloads every DiT
  and encoder) or that a ``device_memory_budget`` evicted.

Its first request still runs (the encoders rest on the device after ``enable``); the
next one builds its intermediates on the CPU and mixes them with the outputs of the
offloaded modules, which run on the device: "Expected all tensors to be on the same
device". diffusers' own model offload answers the question through accelerate's
``_hf_hook.execution_device``; this module answers it for ours.

``follow_offload(pipeline)`` makes ``DiffusionPipeline.device`` and
``DiffusionPipeline._execution_device`` answer the offload device for every pipeline
object one of whose modules carries an active offload hook (``hooks.get_hook``): the
pipeline given to ``enable``, the sub-pipelines nested in it, and pipelines built from
its ``components``, since the answer comes from the shared modules themselves, not from
a list of pipelines. Every other pipeline gets diffusers' own answer. The answer follows
the hooks, so ``disable()`` (which removes them) or a deleted backend restores
diffusers' answer with nothing to undo.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
from torch import nn

from ..hooks import get_hook

__all__ = ["follow_offload", "offload_device"]

_LOCK = threading.Lock()

#: the attributes of ``DiffusionPipeline`` whose answer follows the offload
_PROPERTIES = ("device", "_execution_device")


def offload_device(pipeline: Any) -> torch.device | None:
    """The device the offload hooks on ``pipeline``'s modules load them to, or None when
    none of its modules (the ``nn.Module`` attributes of the pipeline object: diffusers
    registers each component as one) carries an active offload hook.

    O(attributes of the pipeline); no tensor is visited.
    """
    for value in vars(pipeline).values():
        if isinstance(value, nn.Module):
            hook = get_hook(value)
            if hook is not None:
                return hook.device
    return None


def _diffusion_pipeline_base(pipeline: Any) -> type | None:
    """diffusers' ``DiffusionPipeline`` if ``pipeline`` is one (found in its class's MRO,
    so a pipeline that is not a diffusers one does not import diffusers), else None."""
    for cls in type(pipeline).__mro__:
        if cls.__name__ == "DiffusionPipeline" and cls.__module__ == "diffusers.pipelines.pipeline_utils":
            return cls
    return None


def _following(original: property) -> property:
    """``original`` (a property of ``DiffusionPipeline``), answering ``offload_device``
    first when the pipeline's modules are offloaded."""
    getter = original.fget
    assert getter is not None

    @functools.wraps(getter)
    def fget(self: Any) -> Any:
        device = offload_device(self)
        return device if device is not None else getter(self)

    fget._diffusion_offload_original = original  # type: ignore[attr-defined]
    return property(fget, original.fset, original.fdel, original.__doc__)


def follow_offload(pipeline: Any) -> bool:
    """Make diffusers' ``DiffusionPipeline.device`` and ``_execution_device`` answer the
    offload device for every pipeline whose modules carry an active offload hook (see the
    module docstring). Installed once per process, on the first ``enable`` of a diffusers
    pipeline; a pipeline that is not a diffusers ``DiffusionPipeline`` changes nothing.

    Returns True when ``pipeline`` is a diffusers pipeline (its device now follows the
    offload), False otherwise.
    """
    base = _diffusion_pipeline_base(pipeline)
    if base is None:
        return False
    with _LOCK:
        for name in _PROPERTIES:
            current = base.__dict__.get(name)
            if not isinstance(current, property) or current.fget is None:
                continue  # a diffusers without it: nothing to follow
            if hasattr(current.fget, "_diffusion_offload_original"):
                continue  # installed already
            setattr(base, name, _following(current))
    return True
