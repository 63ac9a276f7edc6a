"""diffusion_offload: run diffusion pipelines larger than one accelerator by model-level offload.

Only the executing component group (DiTs or text encoders) sits on the accelerator; the
rest waits in pinned host memory; VAEs stay resident. See README.md and docs/.
"""

from .backend import ModelLevelOffloadBackend
from .config import DiffusionOffloadConfig, parse_diffusion_offload_config
from .discovery import SupportsComponentDiscovery
from .hooks import SequentialOffloadHook, offload_component
from .split import PartSwitcher, SupportsModelCpuOffload
from .transfer import TransferStats

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


def __getattr__(name: str):  # the engine imports diffusers: load it on first use
    if name in ("Omni", "SamplingParams", "GenerationOutput"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'diffusion_offload' has no attribute {name!r}")
