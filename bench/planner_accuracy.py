"""How close the planner's predicted device peak is to the measured one (issue 35 item 4:
admission uses the planner's error bound, 1.10), across output sizes.

For each tiny family (``testing.tiny_pipelines``, saved with ``save_pretrained`` and loaded
back as a real model is), one request per size runs in module mode (DiTs and text
encoders offloaded, ``engine.admission`` off) on the fake device with a negative prompt
(classifier-free guidance on, the engine's default for one), two denoising steps. The
predicted peak is ``planner.plan.predict_peak`` for the same config and request, the
measured one ``fake_accelerator.stats()['peak_bytes']`` (exact byte accounting) of the
second, steady-state request. A ratio above 1 over-predicts (admission stays on the safe
side); the bound admission relies on is ``measured <= predicted <= 1.10 x measured``.

Run: ``HF_HUB_OFFLINE=1 PYTHONPATH=src python bench/planner_accuracy.py [--sizes 32 128 256 512]``.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from pathlib import Path

KINDS = ("wan2.2", "flux", "sd3", "qwen-image")
MODULE = {"mode": "module", "components": ["dit", "text_encoder"]}


def _prompt(kind: str) -> dict[str, str]:
    # Qwen-Image's encoder reads the prompt's own length; the plan assumes the longest
    words = "a photo of a cat " * (400 if kind == "qwen-image" else 1)
    return {"prompt": words.strip(), "negative_prompt": "blurry"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 128, 256, 512],
                        help="square output sides in pixels (default 32 128 256 512)")
    parser.add_argument("--frames", type=int, default=5, help="video frames (default 5)")
    args = parser.parse_args()

    from diffusion_offload import Omni, SamplingParams
    from diffusion_offload.core.config import parse_diffusion_offload_config
    from diffusion_offload.planner.model import load_plan_model
    from diffusion_offload.planner.plan import predict_peak, resolve_request
    from diffusion_offload.testing import fake_accelerator as fa, tiny_pipelines

    fa.install()
    root = Path(tempfile.mkdtemp(prefix="planner-accuracy-"))
    config = parse_diffusion_offload_config(MODULE)
    print("| model | size | frames | predicted B | measured B | predicted / measured |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in KINDS:
        folder = str(tiny_pipelines.save(kind, root / kind))
        pm = load_plan_model(folder)
        frames = args.frames if kind.startswith("wan") else None
        engine = Omni(folder, MODULE, device="fakegpu", progress=False, admission=False)
        try:
            for side in args.sizes:
                request = resolve_request(pm, side, side, frames, 2)
                predicted = predict_peak(pm, request, config, None, device_kind="fakegpu")
                params = SamplingParams(height=side, width=side, num_frames=frames, num_inference_steps=2)
                try:
                    engine.generate(_prompt(kind), params)  # the first request settles the residency
                except ValueError as exc:  # a size the tiny model refuses (SD3's pos_embed_max_size)
                    print(f"| {kind} | {side} | {frames or '-'} | {predicted:,} | refused: "
                          f"{str(exc).splitlines()[0]} | - |", flush=True)
                    continue
                gc.collect()
                fa.reset_stats()
                engine.generate(_prompt(kind), params)
                measured = fa.stats()["peak_bytes"]
                print(f"| {kind} | {side} | {frames or '-'} | {predicted:,} | {measured:,} | "
                      f"{predicted / measured:.4f} |", flush=True)
        finally:
            engine.close()
            gc.collect()


if __name__ == "__main__":
    main()
