"""Issue 21 item 5: ``--lora PATH[:SCALE]`` and ``--guidance-scale`` on ``generate`` (and the
flags ``serve`` shares), run in-process on tiny Wan2.1 with module offload on the fake
accelerator, against diffusers' own LoRA loading on an unoffloaded pipeline."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from diffusion_offload.cli import main  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

CONFIG = json.dumps({"mode": "module", "components": ["dit", "text_encoder"]})


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipelines.save("wan2.1", tmp_path_factory.mktemp("models") / "wan")


def test_generate_lora_and_guidance_equal_diffusers_unoffloaded(
    wan: Path, tmp_path: Path, lora_state_dict: dict[str, torch.Tensor], fake_device: None
) -> None:
    from safetensors.torch import save_file

    from diffusion_offload.engine import Omni, SamplingParams
    from diffusion_offload.engine.media import encode_video

    lora = tmp_path / "style.safetensors"
    save_file({k: v.contiguous() for k, v in lora_state_dict.items()}, str(lora))
    out, report_path = tmp_path / "out.gif", tmp_path / "report.json"
    status = main(["generate", "--model", str(wan), "--device", "fakegpu",
                   "--diffusion-offload-config", CONFIG, "--lora", f"{lora}:0.5",
                   "--guidance-scale", "3.5", "--output", str(out), "--report", str(report_path)])
    assert status == 0
    report = json.loads(report_path.read_text())
    request = report["request"]
    assert request["loras"] == [[str(lora), 0.5]] and request["guidance_scale"] == 3.5
    assert report["offload_stats"]["loads"] > 0  # it ran offloaded

    with Omni(str(wan), device="cpu", progress=False) as ref:  # no offload
        ref.pipeline.load_lora_weights(str(lora), adapter_name="a")
        ref.pipeline.set_adapters(["a"], adapter_weights=[0.5])
        params = SamplingParams(
            height=request["height"], width=request["width"], num_frames=request["num_frames"],
            num_inference_steps=request["num_inference_steps"], seed=request["seed"],
            guidance_scale=3.5,
        )
        frames = ref.generate(request["prompt"], params)[0].frames[0]
        ref.pipeline.set_adapters(["a"], adapter_weights=[0.0])  # the LoRA changes the output
        plain = ref.generate(request["prompt"], params)[0].frames[0]
    assert out.read_bytes() == encode_video(frames, request["fps"], ".gif")
    assert encode_video(plain, request["fps"], ".gif") != out.read_bytes()


def test_lora_flag_errors_are_one_line(wan: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "nope.safetensors"
    assert main(["generate", "--model", str(wan), "--lora", f"{missing}:0.5"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"diffusion-offload: error: --lora: {str(missing)!r} does not exist (give a LoRA file, "
        "folder or hub id)"]
    lora = tmp_path / "x.safetensors"
    lora.write_bytes(b"")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    assert main(["serve", str(wan), "--lora", str(lora), "--port", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"diffusion-offload: error: --lora {lora} needs peft, which is not installed; install it "
        "with pip install 'diffusion_offload[lora]'"]
