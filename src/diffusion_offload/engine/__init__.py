"""The offline engine: ``Omni``, ``SamplingParams``, ``GenerationOutput``.

Names are imported on first use (PEP 562), so the torch-free submodules (``media``,
``model_files`` helpers used before a model loads) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["FitError", "GenerationOutput", "ModelError", "Omni", "SamplingParams", "pick_device"]

_LAZY = {
    "FitError": ".fit",
    "ModelError": ".model_files",
    "Omni": ".omni",
    "pick_device": ".omni",
    "GenerationOutput": ".params",
    "SamplingParams": ".params",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its submodule on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'diffusion_offload.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
