"""diffusion_offload: run diffusion pipelines larger than one accelerator by model-level offload
(or, in layer mode, by streaming DiT blocks).

Only the executing component group (DiTs or text encoders) sits on the accelerator; the
rest waits in pinned host memory; VAEs stay resident. See README.md and docs/.

Every public name is imported on first use (PEP 562), so ``import diffusion_offload``
(and ``diffusion-offload --help``) does not import torch.
"""

from __future__ import annotations

from .lazy import lazy_exports

__all__ = [
    "DiffusionOffloadConfig",
    "GenerationOutput",
    "LayerwiseOffloadBackend",
    "ModelLevelOffloadBackend",
    "Omni",
    "PartSwitcher",
    "PlanRow",
    "SamplingParams",
    "SequentialOffloadHook",
    "SupportsComponentDiscovery",
    "SupportsModelCpuOffload",
    "TransferStats",
    "offload_component",
    "parse_diffusion_offload_config",
    "plan_offload",
]

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {
    "ModelLevelOffloadBackend": ".core.backends.module",
    "LayerwiseOffloadBackend": ".core.backends.layer",
    "DiffusionOffloadConfig": ".core.config",
    "parse_diffusion_offload_config": ".core.config",
    "SupportsComponentDiscovery": ".core.discovery",
    "SequentialOffloadHook": ".core.hooks",
    "offload_component": ".core.hooks",
    "PartSwitcher": ".core.backends.split",
    "SupportsModelCpuOffload": ".core.backends.split",
    "TransferStats": ".core.stats",
    "Omni": ".engine",
    "SamplingParams": ".engine",
    "GenerationOutput": ".engine",
    "PlanRow": ".planner",
    "plan_offload": ".planner",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__, globals())
