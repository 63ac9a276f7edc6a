"""``diffusion_offload.hooks``: the offload hooks, at their path from before the offload
core became ``diffusion_offload.core``. This name is the module
``diffusion_offload.core.hooks`` itself (the same objects), kept so that code written
against the old path keeps importing."""

from __future__ import annotations

import sys

from .core import hooks

sys.modules[__name__] = hooks
