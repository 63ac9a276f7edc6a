"""Issue 21 item 6: every bad input to ``plan`` (and ``load_plan_model``, what
``plan_offload`` reads) is one line, exit 2, naming the file or the field; a
``model_index.json`` component outside the model folder is refused, reading nothing there.
``diffusion-offload plan`` runs in-process (``cli.main``) over broken copies of tiny Wan2.1."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from diffusion_offload.cli import main  # noqa: E402
from diffusion_offload.models.files import ModelError  # noqa: E402
from diffusion_offload.planner.model import load_plan_model  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

PREFIX = "diffusion-offload: error: "


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipelines.save("wan2.1", tmp_path_factory.mktemp("models") / "wan")


def _index(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(model: Path) -> None:
        index = json.loads((model / "model_index.json").read_text())
        edit(index)
        (model / "model_index.json").write_text(json.dumps(index))
    return apply


def _weights(data: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def apply(model: Path) -> None:
        (weights,) = (model / "transformer").glob("*.safetensors")
        weights.write_bytes(data(weights.read_bytes()))
    return apply


CASES = {
    "unknown class": (
        _index(lambda i: i.update(transformer=["diffusers", "NoSuchTransformer"])),
        "'{m}/model_index.json': component 'transformer' is diffusers.NoSuchTransformer, which is "
        "not available here (unknown class, or diffusers not installed)"),
    "non-string entry": (
        _index(lambda i: i.update(vae=["diffusers", 5])),
        "'{m}/model_index.json': component 'vae' must be [library, class] as two strings, e.g. "
        "[\"diffusers\", \"AutoencoderKLWan\"], got [\"diffusers\", 5]"),
    "truncated weights": (
        _weights(lambda b: b[:100]),
        "weight file '{m}/transformer/diffusion_pytorch_model.safetensors' cannot be read: "
        "truncated or corrupt (Error while deserializing header: invalid header length)"),
    "empty weights": (
        _weights(lambda b: b""),
        "weight file '{m}/transformer/diffusion_pytorch_model.safetensors' cannot be read: "
        "truncated or corrupt (Error while deserializing header: header too small)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_model_files_are_one_line_exit_2(case: str, wan: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    edit, message = CASES[case]
    model = tmp_path / "m"
    shutil.copytree(wan, model)
    edit(model)
    assert main(["plan", str(model), "--device-memory", "1GiB"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == [PREFIX + message.format(m=model)]
    with pytest.raises(ModelError) as err:  # the Python API: the same message
        load_plan_model(model)
    assert str(err.value) == message.format(m=model)


def test_component_outside_the_model_folder_is_refused_reading_nothing(
    wan: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    model = tmp_path / "m"
    shutil.copytree(wan, model)
    outside = tmp_path / "outside"
    shutil.copytree(wan / "transformer", outside)
    _index(lambda i: i.update({"../outside": ["diffusers", "WanTransformer3DModel"]}))(model)
    opened: list[str] = []
    watching = [True]

    def audit(event: str, args: tuple) -> None:  # audit hooks stay: this one only while watching
        if watching[0] and event == "open" and isinstance(args[0], (str, os.PathLike)):
            opened.append(os.path.realpath(args[0]))

    sys.addaudithook(audit)
    try:
        status = main(["plan", str(model), "--device-memory", "1GiB"])
    finally:
        watching[0] = False
    assert status == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{PREFIX}'{model}/model_index.json': component '../outside' is not a folder name of the "
        "model (no '/', '\\' or '..'); nothing outside the model folder is read"]
    assert [p for p in opened if p.startswith(str(outside.resolve()))] == []


def test_shape_beyond_the_model_and_cpu_without_memory(wan: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(wan), "--device-memory", "1GiB", "--height", "100000"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{PREFIX}--height 100000 is more than WanPipeline can generate: its transformer's "
        "rope_max_seq_len of 32 allows at most 512 pixels"]
    assert main(["plan", str(wan), "--num-frames", "129", "--device-memory", "1GiB"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{PREFIX}--num-frames 129 is more than WanPipeline can generate: its transformer's "
        "rope_max_seq_len of 32 allows at most 125 frames"]
    assert main(["plan", str(wan), "--device-kind", "cpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{PREFIX}--device-kind cpu needs --device-memory (a CPU has no device memory of its "
        "own to read), e.g. --device-memory 64GiB"]
