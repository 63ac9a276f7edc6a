"""``diffusion_offload.config``: the offload configuration, at its path from before the
offload core became ``diffusion_offload.core``. This name is the module
``diffusion_offload.core.config`` itself (the same objects), kept so that code written
against the old path keeps importing."""

from __future__ import annotations

import sys

from .core import config

sys.modules[__name__] = config
