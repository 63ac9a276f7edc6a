"""The offline engine: ``Omni``, ``SamplingParams``, ``GenerationOutput``.

Names are imported on first use (PEP 562), so the torch-free submodules (``media``,
``model_files`` helpers used before a model loads) can be imported without torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

__all__ = ["FitError", "GenerationOutput", "ModelError", "Omni", "SamplingParams", "pick_device"]

_LAZY = {
    "FitError": ".fit",
    "ModelError": ".model_files",
    "Omni": ".omni",
    "pick_device": ".omni",
    "GenerationOutput": ".params",
    "SamplingParams": ".params",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__, globals())
