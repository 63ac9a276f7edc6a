"""``diffusion_offload.hostmem``: host memory for host copies, at its path from before the
offload core became ``diffusion_offload.core``. This name is the module
``diffusion_offload.core.hostmem`` itself (not a copy of its names), so code that replaces
one of its functions (a test reporting less available host memory, say) changes what the
engine calls."""

from __future__ import annotations

import sys

from .core import hostmem

sys.modules[__name__] = hostmem
