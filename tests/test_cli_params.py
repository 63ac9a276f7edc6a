"""``diffusion-offload generate --param NAME=VALUE`` (issue 24 item 1): the knobs that
``serve`` takes, checked the same way and before any weight is read."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from diffusion_offload.cli import main  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402


@pytest.fixture(scope="module")
def flux(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipelines.save("flux", tmp_path_factory.mktemp("cli_params") / "flux")


def _generate(flux: Path, out: Path, *extra: str) -> int:
    return main(["generate", "--model", str(flux), "--device", "cpu", "--steps", "1",
                 "--height", "16", "--width", "16", "--output", str(out), *extra])


def test_param_reaches_the_pipeline(flux: Path, tmp_path: Path) -> None:
    assert _generate(flux, tmp_path / "a.png", "--negative-prompt", "blurry") == 0
    assert _generate(flux, tmp_path / "b.png", "--negative-prompt", "blurry",
                     "--param", "true_cfg_scale=4") == 0
    assert _generate(flux, tmp_path / "c.png", "--negative-prompt", "blurry",
                     "--param", "true_cfg_scale=6", "--param", "max_sequence_length=64") == 0
    a, b, c = ((tmp_path / f"{x}.png").read_bytes() for x in "abc")
    assert a == b  # the documented default: true_cfg_scale 4.0 with a negative prompt
    assert c != a


@pytest.mark.parametrize("param,message", [
    ("latents=1", "'latents' cannot be set by a request"),
    ("num_images_per_prompt=2", "use 'n'"),
    ("colour=red", "FluxPipeline takes no 'colour'; it takes: "),
    ("true_cfg_scale=high", "expected a number"),
    ("sigmas=[1,2,3]", "sigmas"),
    ("true_cfg_scale", "write NAME=VALUE"),
    ("height=32", "give height as --height"),
])
def test_bad_param_is_one_line_exit_2(flux: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                                     param: str, message: str) -> None:
    assert _generate(flux, tmp_path / "x.png", "--param", param) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffusion-offload: error: ") and message in err[0], err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.slow
def test_image_and_mask_edit_like_the_engine(flux: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    import numpy as np
    from PIL import Image

    from diffusion_offload.engine import Omni, SamplingParams

    picture = Image.fromarray((np.arange(16 * 16 * 3).reshape(16, 16, 3) * 5 % 251).astype("uint8"))
    mask = Image.new("L", (16, 16), 0)
    mask.paste(255, (4, 4, 12, 12))
    picture.save(tmp_path / "in.png")
    mask.save(tmp_path / "mask.png")
    steps = ["--param", "strength=0.9", "--steps", "2"]
    assert _generate(flux, tmp_path / "edit.png", "--image", str(tmp_path / "in.png"), *steps) == 0
    assert _generate(flux, tmp_path / "inpaint.png", "--image", str(tmp_path / "in.png"),
                     "--mask", str(tmp_path / "mask.png"), *steps) == 0
    params = SamplingParams(height=16, width=16, num_inference_steps=2, seed=0, extra={"strength": 0.9})
    with Omni(str(flux), device="cpu", progress=False) as engine:
        for name, item in (("edit", {"image": picture}), ("inpaint", {"image": picture, "mask": mask})):
            alone = engine.generate({"prompt": "a red fox running through fresh snow", **item}, params)[0].images[0]
            got = np.asarray(Image.open(tmp_path / f"{name}.png"))
            assert np.array_equal(got, np.asarray(alone)), name
    capsys.readouterr()
    assert _generate(flux, tmp_path / "x.png", "--mask", str(tmp_path / "mask.png")) == 2
    assert "--mask needs --image" in capsys.readouterr().err
    assert _generate(flux, tmp_path / "x.png", "--image", str(tmp_path / "nope.png")) == 2
    assert "no such file" in capsys.readouterr().err
