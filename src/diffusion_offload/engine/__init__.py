"""The offline engine: ``Omni``, ``SamplingParams``, ``GenerationOutput``.

Names are imported on first use (PEP 562), so the torch-free submodule ``media`` can be
imported without torch. ``ModelError`` and ``FitError`` are defined in ``diffusion_offload.models``;
``AdmissionError`` (a ``FitError``) in ``engine.admission``.
"""

from __future__ import annotations

from ..lazy import lazy_exports

__all__ = ["AdmissionError", "FitError", "GenerationOutput", "ModelError", "ModelPool", "ModelSpec", "Omni", "SamplingParams",
           "pick_device"]

_LAZY = {
    "AdmissionError": ".admission",
    "FitError": "..models.fit",
    "ModelError": "..models.files",
    "Omni": ".omni",
    "ModelPool": ".pool",
    "ModelSpec": ".pool",
    "pick_device": ".omni",
    "GenerationOutput": ".params",
    "SamplingParams": ".params",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, __all__, globals())
