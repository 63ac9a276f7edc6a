"""``diffusion-offload serve ARGS`` with the engine replaced by a stub (a test helper, run as
``python tests/serve_stub.py MODEL_DIR [serve flags]``).

Everything but the engine is the real command: flag parsing, validation of the model
folder, binding, uvicorn with the connection limits, signals, shutdown. The stub makes
videos of the requested size at once; a prompt containing ``STUCK`` blocks for 60 s
without ever reporting a step, like a long native call that cannot be interrupted.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class StubEngine:
    """``generate`` and ``is_video`` only: what the server needs."""

    is_video = True

    def generate(self, prompts: Any, params: Any) -> list[Any]:
        from PIL import Image

        from diffusion_offload.engine import GenerationOutput

        text = prompts if isinstance(prompts, str) else prompts["prompt"]
        if "STUCK" in text:
            time.sleep(60)
        frame = Image.new("RGB", (params.width or 16, params.height or 16), 90)
        return [GenerationOutput(prompt=text, frames=[[frame] * (params.num_frames or 1)])]


def main() -> int:
    from diffusion_offload import cli
    from diffusion_offload.engine import omni

    omni.build_omni = lambda *args, **kwargs: StubEngine()  # serve() imports it at call time
    return cli.main(["serve", *sys.argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
