"""The offline engine: ``Omni``, ``SamplingParams``, ``GenerationOutput``."""

from .fit import FitError
from .model_files import ModelError
from .omni import Omni, pick_device
from .params import GenerationOutput, SamplingParams

__all__ = ["FitError", "GenerationOutput", "ModelError", "Omni", "SamplingParams", "pick_device"]
