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
