"""diffusion_offload: run diffusion pipelines larger than one accelerator by model-level offload.

Only the executing component group (DiTs or text encoders) sits on the accelerator; the
rest waits in pinned host memory; VAEs stay resident. See README.md and docs/.

Every public name is imported on first use (PEP 562), so ``import diffusion_offload``
(and ``diffusion-offload --help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "DiffusionOffloadConfig",
    "GenerationOutput",
    "ModelLevelOffloadBackend",
    "Omni",
    "PartSwitcher",
    "SamplingParams",
    "SequentialOffloadHook",
    "SupportsComponentDiscovery",
    "SupportsModelCpuOffload",
    "TransferStats",
    "offload_component",
    "parse_diffusion_offload_config",
]

__version__ = "0.1.0"

# public name -> the submodule that defines it
_LAZY = {
    "ModelLevelOffloadBackend": ".backend",
    "DiffusionOffloadConfig": ".config",
    "parse_diffusion_offload_config": ".config",
    "SupportsComponentDiscovery": ".discovery",
    "SequentialOffloadHook": ".hooks",
    "offload_component": ".hooks",
    "PartSwitcher": ".split",
    "SupportsModelCpuOffload": ".split",
    "TransferStats": ".transfer",
    "Omni": ".engine",
    "SamplingParams": ".engine",
    "GenerationOutput": ".engine",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its submodule on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diffusion_offload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
