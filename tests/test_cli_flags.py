"""Issue 21 items 7-8: silent values and hints. Size flags need a unit, a budget needs a
module-mode config, an offline or unreachable hub id and a missing weight file are named
as such; ``cli.main`` runs in-process, refusing before any weight is read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from diffusion_offload.cli import main  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

PREFIX = "diffusion-offload: error: "
UNIT = "has no unit; give a unit, e.g. 24GiB (B, KiB, MiB, GiB, TiB, or kB, MB, GB, TB)"
LAYER = json.dumps({"mode": "layer", "components": ["dit"]})


@pytest.fixture(scope="module")
def wan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipelines.save("wan2.1", tmp_path_factory.mktemp("models") / "wan")


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), lines
    return lines[0][len(PREFIX):]


def test_size_flags_refuse_a_bare_number(wan: Path, capsys: pytest.CaptureFixture,
                                         tmp_path: Path) -> None:
    out = ["--output", str(tmp_path / "x.gif")]
    assert _error(capsys, ["plan", str(wan), "--device-memory", "24"]) == f"--device-memory: '24' {UNIT}"
    assert _error(capsys, ["generate", "--model", str(wan), "--max-pinned-memory", "512", *out]) == \
        f"--max-pinned-memory: '512' {UNIT}"
    assert _error(capsys, ["serve", str(wan), "--device-memory-budget", "70"]) == \
        f"--device-memory-budget: '70' {UNIT}; or auto"
    assert list(tmp_path.iterdir()) == []


def test_budget_needs_an_offload_config(wan: Path, capsys: pytest.CaptureFixture) -> None:
    for command in (["generate", "--model", str(wan)], ["serve", str(wan)]):
        assert _error(capsys, [*command, "--device-memory-budget", "2GiB"]) == (
            "--device-memory-budget 2.00GiB needs an offload config (without one "
            "everything stays on the device); add --diffusion-offload-config "
            "'{\"mode\":\"module\",\"components\":[\"dit\",\"text_encoder\"]}' (or auto), or drop it")
    # layer mode takes a budget too (issue 18): accepted up to the device check
    assert "--device-memory-budget" not in _error(
        capsys, ["generate", "--model", str(wan), "--diffusion-offload-config", LAYER,
                 "--device-memory-budget", "1GiB", "--device", "cuda"])
    # layer mode takes --max-pinned-memory: accepted up to the device check (no accelerator)
    assert "--max-pinned-memory" not in _error(
        capsys, ["generate", "--model", str(wan), "--diffusion-offload-config", LAYER,
                 "--max-pinned-memory", "1GiB", "--device", "cuda"])


def test_hub_id_offline_unreachable_and_a_missing_weight_file(
    wan: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub
    import huggingface_hub.constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert _error(capsys, ["generate", "--model", "nobody/none"]) == (
        "model 'nobody/none' is not a local directory and was not found in the local Hugging "
        "Face cache (HF_HUB_OFFLINE=1 keeps the hub out); download it first with `hf download "
        "nobody/none`, or pass a pipeline folder")

    def unreachable(*args: object, **kwargs: object) -> None:  # what the hub raises offline
        raise LocalEntryNotFoundError("Got: ConnectError: [Errno 111] Connection refused An error "
                                      "happened while trying to locate the files on the Hub")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    assert _error(capsys, ["generate", "--model", "nobody/none"]) == (
        "model 'nobody/none' is not a local directory, is not in the local Hugging Face cache, "
        "and the hub could not be reached (LocalEntryNotFoundError: Got: ConnectError: [Errno "
        "111] Connection refused); connect to the network, or download it first with `hf "
        "download nobody/none`")

    model = tmp_path / "m"
    shutil.copytree(wan, model)
    (model / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    assert _error(capsys, ["generate", "--model", str(model), "--output", str(tmp_path / "x.gif")]) == (
        f"component 'transformer' has no weight file: "
        f"'{model}/transformer/diffusion_pytorch_model.safetensors' (or the shards of "
        "diffusion_pytorch_model.safetensors.index.json) is missing; download the model again")


def test_from_report_of_auto_replays_its_budget(wan: Path, tmp_path: Path, fake_device: None,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    from diffusion_offload.testing import fake_accelerator

    # 14.9 MB free: all resident does not fit (14.93 MB peak), module + budget does (plan)
    held = fake_accelerator.stats()["allocated_bytes"]  # what earlier tests still hold
    monkeypatch.setenv("DIFFUSION_OFFLOAD_FAKE_CAPACITY", str(held + 14_900_000))
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    assert main(["generate", "--model", str(wan), "--device", "fakegpu", "--diffusion-offload-config",
                 "auto", "--output", str(tmp_path / "a.gif"), "--report", str(first)]) == 0
    ran = json.loads(first.read_text())
    assert ran["request"]["diffusion_offload_config"]["mode"] == "module"
    assert isinstance(ran["request"]["device_memory_budget"], int)  # auto's pick, recorded
    assert main(["generate", "--from-report", str(first), "--output", str(tmp_path / "b.gif"),
                 "--report", str(again)]) == 0
    replay = json.loads(again.read_text())
    assert replay["request"]["device_memory_budget"] == ran["request"]["device_memory_budget"]
    assert replay["offload_stats"]["evictions"] == ran["offload_stats"]["evictions"] == 0
    assert replay["offload_stats"]["h2d_bytes"] == ran["offload_stats"]["h2d_bytes"]
    assert (tmp_path / "a.gif").read_bytes() == (tmp_path / "b.gif").read_bytes()
    capsys.readouterr()


def test_the_cpu_no_op_is_said_once(wan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    caplog: pytest.LogCaptureFixture) -> None:
    from diffusion_offload.testing import fake_accelerator

    monkeypatch.setattr(fake_accelerator, "is_installed", lambda: False)  # a CPU-only machine
    with caplog.at_level("INFO"):
        assert main(["generate", "--model", str(wan), "--diffusion-offload-config",
                     '{"mode":"module","components":["dit"]}', "--output", str(tmp_path / "a.gif")]) == 0
    said = [r.getMessage() for r in caplog.records if "cpu" in r.getMessage().lower()]
    assert said == ["no accelerator found: running on the CPU",
                    "device is cpu: the offload config is accepted but offload is a no-op"]


def test_the_fit_advice_comes_from_the_planners_peaks(wan: Path, tmp_path: Path, fake_device: None,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    # 200 kB: no offload does not fit at rest, module dit+text_encoder would at rest (169 kB)
    # but its predicted peak (activations) is ~14 MB: the advice must not suggest it
    monkeypatch.setenv("DIFFUSION_OFFLOAD_FAKE_CAPACITY", "200000")
    message = _error(capsys, ["generate", "--model", str(wan), "--device", "fakegpu",
                              "--output", str(tmp_path / "a.gif")])
    assert message.startswith("model does not fit: config no offload needs ")
    assert ("; the planner predicts that no candidate fits in 195.3 KiB (200000 bytes) for 32x32, "
            "5 frames, 2 steps on fakegpu; the smallest need is ") in message
    assert "try --diffusion-offload-config" not in message
    assert list(tmp_path.iterdir()) == []
