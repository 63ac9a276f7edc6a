"""``python -m diffusion_offload``: the ``diffusion-offload`` command line."""

from .cli import main

raise SystemExit(main())
