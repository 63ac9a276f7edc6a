"""Issue 9: help, version, start-up time, and model files read as diffusers reads them."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffusion_offload.cli_args import build_parser
from diffusion_offload.units import parse_bytes

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _run(*argv: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "diffusion_offload", *argv],
                          capture_output=True, text=True, timeout=60, env=ENV)
    return proc, time.perf_counter() - start


def test_every_option_has_help_with_its_default() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {"generate", "serve", "make-tiny", "plan"}
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest} has no help"
            assert "default" in action.help or "required" in action.help, f"{name} {action.dest}: {action.help!r}"


def test_serve_help_lists_every_request_field() -> None:
    from diffusion_offload.server.schemas import ImageGenerationRequest, VideoGenerationRequest

    proc, _ = _run("serve", "--help")
    assert proc.returncode == 0
    for field in set(ImageGenerationRequest.model_fields) | set(VideoGenerationRequest.model_fields):
        assert field in proc.stdout, field
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for field in set(ImageGenerationRequest.model_fields) | set(VideoGenerationRequest.model_fields):
        assert f"`{field}`" in readme, f"README lacks the server field {field}"


def test_help_version_and_config_errors_answer_fast_without_torch() -> None:
    from diffusion_offload.cli_args import version

    proc, seconds = _run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"diffusion-offload {version()}"
    assert seconds < 0.5, f"--version took {seconds:.2f} s"
    proc, seconds = _run("generate", "--help")
    assert proc.returncode == 0 and "--from-report" in proc.stdout
    assert seconds < 0.5, f"--help took {seconds:.2f} s"
    proc, seconds = _run("generate", "--diffusion-offload-config", '{"mode": "module"}')
    assert proc.returncode == 2 and proc.stderr.startswith("diffusion-offload: error: --diffusion-offload-config")
    assert seconds < 0.5, f"a config error took {seconds:.2f} s"
    proc, seconds = _run("generate", "--steps", "-3")
    assert proc.stderr == "diffusion-offload: error: --steps: must be an integer >= 1, got '-3'\n"
    code = ("import sys, diffusion_offload.cli, diffusion_offload.cli_args; "
            "diffusion_offload.cli_args.build_parser(); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=ENV).stdout.strip() == "False"


def test_parse_bytes() -> None:
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1048576") == 1048576
    with pytest.raises(ValueError, match="'12XB' is not a size"):
        parse_bytes("12XB")


def test_max_pinned_memory_and_variant_reach_omni(monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusion_offload.engine import omni
    from diffusion_offload.engine.omni import build_omni

    seen = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(omni, "Omni", Recorder)
    build_omni("m", None, variant="fp16", max_pinned_bytes=40 * 2**30)
    assert seen["max_pinned_bytes"] == 40 * 2**30 and seen["variant"] == "fp16"


# ---------------------------------------------------------------------- model files


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusion_offload.testing import tiny_pipelines

    return tiny_pipelines.save("flux", tmp_path_factory.mktemp("m") / "flux")


def _shard(folder: Path, stem: str = "diffusion_pytorch_model") -> None:
    """Split ``stem.safetensors`` into two shards plus the index diffusers writes."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / f"{stem}.safetensors"))
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, 1):
        shard = f"{stem}-0000{i}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / shard))
        weight_map.update({n: shard for n in part})
    (folder / f"{stem}.safetensors").unlink()
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_checkpoints_count_their_shards(flux_dir: Path, tmp_path: Path) -> None:
    from diffusion_offload.engine import ModelError
    from diffusion_offload.models.files import inspect_model, weight_files

    sharded = shutil.copytree(flux_dir, tmp_path / "sharded")
    _shard(sharded / "transformer")
    assert inspect_model(sharded).numels == inspect_model(flux_dir).numels
    assert [p.name for p in weight_files(sharded)["transformer"]] == [
        "diffusion_pytorch_model-00001-of-00002.safetensors", "diffusion_pytorch_model-00002-of-00002.safetensors"]
    (sharded / "transformer" / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="names shard 'diffusion_pytorch_model-00002-of-00002.safetensors', which is missing"):
        inspect_model(sharded)


def test_omni_raises_model_error_for_a_corrupt_file(flux_dir: Path, tmp_path: Path) -> None:
    from diffusion_offload.engine import ModelError, Omni

    broken = shutil.copytree(flux_dir, tmp_path / "broken")
    weights = broken / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(b"\xff" * 8 + b"garbage")
    with pytest.raises(ModelError, match=f"weight file '{weights}' cannot be read: truncated or corrupt"):
        Omni(str(broken), device="cpu", progress=False)


def test_size_rules_come_from_the_model_config(flux_dir: Path) -> None:
    from diffusion_offload.models.files import inspect_model
    from diffusion_offload.models.rules import frames_for_seconds, model_rules

    rules = model_rules(inspect_model(flux_dir))
    assert (rules.size_multiple, rules.frame_step, rules.tiny_kind) == (4, None, "flux")
    with pytest.raises(ValueError, match="--height 30 is not allowed by FluxPipeline: it must be a multiple of 4"):
        rules.check({"height": 30}, {"height": "--height"})
    assert frames_for_seconds(4, 16, 4) == 65 and frames_for_seconds(0.01, 16, 4) == 1
