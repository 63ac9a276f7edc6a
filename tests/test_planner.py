"""The planner: shipped configs, memory accounting, residency rules, CLI and ``auto`` parsing."""

from __future__ import annotations

import json
import time

import pytest
import torch

from diffusion_offload import PlanRow, parse_diffusion_offload_config, plan_offload
from diffusion_offload.cli import main
from diffusion_offload.models.files import ModelError
from diffusion_offload.planner.memory import LiveBytes, attention_model
from diffusion_offload.planner.model import configs_root, load_plan_model, shipped_models
from diffusion_offload.planner.plan import (
    fastest_fitting,
    format_plan,
    plan_model,
    resolve_request,
)
from diffusion_offload.planner.published import MODELS, write_configs
from diffusion_offload.testing import tiny_pipelines

GiB = 2**30

# published parameter counts (issue 13), tolerance 2 %
PUBLISHED = [
    ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "transformer", 14.3e9),
    ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "transformer_2", 14.3e9),
    ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "text_encoder", 5.7e9),
    ("black-forest-labs/FLUX.1-dev", "transformer", 11.9e9),
    ("stabilityai/stable-diffusion-3.5-large", "transformer", 8.1e9),
    ("Qwen/Qwen-Image", "transformer", 20.4e9),
]


@pytest.fixture(scope="module")
def shipped():
    cache: dict = {}

    def get(hub_id: str):
        if hub_id not in cache:
            cache[hub_id] = load_plan_model(hub_id)
        return cache[hub_id]

    return get


@pytest.mark.parametrize("hub_id, component, params", PUBLISHED)
def test_shipped_configs_match_published_sizes(hub_id, component, params, shipped):
    pm = shipped(hub_id)
    assert pm.weightless and pm.dtype == torch.bfloat16
    size = pm.components[component]
    assert abs(size.params - params) <= 0.02 * params, (hub_id, component, size.params)
    assert size.source == "config (weightless)"
    # the meta-built module really has that many parameters
    assert sum(p.numel() for p in pm.modules[component].parameters()) == size.params


def test_wan21_dit_size(shipped):
    size = shipped("Wan-AI/Wan2.1-T2V-1.3B-Diffusers").components["transformer"]
    assert 1.3e9 <= size.params <= 1.5e9
    # each Wan2.2 expert in bf16: 28.6 GB (the README's number); 2 bytes per parameter
    expert = shipped("Wan-AI/Wan2.2-T2V-A14B-Diffusers").components["transformer"]
    assert abs(expert.nbytes - 28.6e9) <= 0.02 * 28.6e9


def test_shipped_configs_are_the_published_ones(tmp_path):
    assert shipped_models() == sorted(MODELS)
    written = write_configs(tmp_path)
    for folder in written:
        hub_id = f"{folder.parent.name}/{folder.name}"
        for file in sorted(folder.rglob("*.json")):
            relative = file.relative_to(folder)
            shipped_file = configs_root() / hub_id / relative
            assert shipped_file.is_file(), shipped_file
            if relative.name == "model_index.json":
                continue  # records the diffusers version that wrote it
            assert json.loads(file.read_text()) == json.loads(shipped_file.read_text()), relative


@pytest.mark.parametrize("hub_id", sorted(MODELS))
def test_plan_of_each_shipped_config_is_fast_and_offline(hub_id, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shape = {"height": 720, "width": 1280, "num_frames": 81} if "Wan" in hub_id else {}
    start = time.perf_counter()
    rows = plan_offload(hub_id, 80 * GiB, steps=40, **shape)
    seconds = time.perf_counter() - start
    assert seconds < 10, seconds
    names = [r.name for r in rows]
    assert names[:4] == ["all resident", "module dit+text_encoder", "module dit",
                         "module text_encoder"]
    resident, strict = rows[0], rows[1]
    assert strict.peak_bytes < resident.peak_bytes
    assert resident.h2d_bytes_per_request == 0
    for row in rows:
        assert row.resting_bytes <= row.peak_bytes
        assert row.transfer_seconds == pytest.approx(row.h2d_bytes_per_request / 25e9)
    assert any(n.startswith("layer") for n in names)
    assert any(n.endswith("budget") for n in names)


def test_wan22_720p_numbers(shipped):
    """The README's table: Wan2.2-T2V-A14B at 1280x720, 81 frames, 40 steps, CUDA."""
    pm = shipped("Wan-AI/Wan2.2-T2V-A14B-Diffusers")
    request = resolve_request(pm, 720, 1280, 81, 40)
    rows = {r.name: r for r in plan_model(pm, request, 80 * GiB)}
    expert = pm.components["transformer"].nbytes
    encoder = pm.components["text_encoder"].nbytes
    vae = pm.components["vae"].nbytes
    strict = rows["module dit+text_encoder"]
    # one expert (the largest group) plus the VAE at rest; every component loaded once
    assert strict.resting_bytes == expert + vae
    assert strict.h2d_bytes_per_request == 2 * expert + encoder
    assert rows["all resident"].resting_bytes == 2 * expert + encoder + vae
    # module strict fits 48 GiB, not 24 GiB (one expert alone is 26.7 GiB)
    assert 24 * GiB < strict.peak_bytes <= 48 * GiB
    assert 48 * GiB < rows["all resident"].peak_bytes <= 80 * GiB
    # the activations at 720p are GiBs (fused attention: no 75600^2 scores)
    assert 4 * GiB < strict.peak_bytes - strict.resting_bytes < 16 * GiB


def test_math_attention_materialises_scores(shipped):
    from diffusion_offload.planner.stages import measure_request

    pm = shipped("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    request = resolve_request(pm, 480, 832, 17, 2)
    tokens = 5 * 30 * 52  # latent frames x (480/16) x (832/16)
    scores = 12 * tokens * tokens * 4  # 12 heads, float32: 2.92e9 bytes
    fused = dict(measure_request(pm, request, "cuda").segments)["transformer"]
    math = dict(measure_request(pm, request, "mps").segments)["transformer"]
    assert fused < scores / 4  # no score matrix at all
    assert math >= 2 * scores  # the scores and their softmax live at once


# ---------------------------------------------------------------------- accounting


def test_live_bytes_counts_allocations_views_and_frees():
    with torch.no_grad(), LiveBytes() as live:
        a = torch.empty(1000, dtype=torch.float32, device="meta")
        assert live.now == 4000
        view = a[10:20].view(2, 5)
        assert live.now == 4000  # a view adds nothing
        b = a * 2
        assert live.now == 8000
        del a
        assert live.now == 8000  # the view keeps the storage
        del view
        assert live.now == 4000
        del b
        assert live.now == 0
        assert live.peak == 8000


def test_live_bytes_ignores_weights_and_memoises_repeated_ops():
    weight = torch.empty(256, 256, device="meta")
    with torch.no_grad(), LiveBytes() as live:
        x = torch.empty(8, 256, device="meta")
        y = torch.nn.functional.linear(x, weight)
        z = torch.nn.functional.linear(x, weight)  # memoised: same result metadata
        assert y.shape == z.shape == (8, 256) and y.stride() == z.stride()
        assert live.now == 3 * 8 * 256 * 4
        t = weight.t()  # a view of a weight: not counted
        assert live.now == 3 * 8 * 256 * 4
        del t, y, z, x
    assert live.now == 0 and live.peak == 3 * 8 * 256 * 4


def test_data_dependent_scalars_take_the_explicit_mask_path():
    with torch.no_grad(), LiveBytes() as live:
        mask = torch.empty(4, dtype=torch.bool, device="meta")
        assert bool(mask.all()) is False
        assert live.scalars == 1


@pytest.mark.parametrize("kind, materialised", [("cuda", False), ("cpu", False),
                                                ("fakegpu", False), ("mps", True)])
def test_attention_memory_model_follows_device_kind(kind, materialised):
    q = torch.empty(1, 2, 1024, 16, dtype=torch.bfloat16, device="meta")
    with torch.no_grad(), attention_model(kind)(), LiveBytes() as live:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        assert out.shape == (1, 2, 1024, 16)
    scores = 2 * 1024 * 1024 * 4
    assert (live.peak >= scores) is materialised


# ---------------------------------------------------------------------- rows


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-wan2.2")
    tiny_pipelines.save("wan2.2", path)
    return path


def test_rows_on_a_tiny_pipeline(tiny_wan):
    pm = load_plan_model(tiny_wan)
    assert pm.dtype == torch.float32 and not pm.weightless
    assert all(c.source == "safetensors headers" for c in pm.components.values())
    request = resolve_request(pm, 32, 32, 5, 2)
    rows = plan_model(pm, request, 1 << 40, device_kind="fakegpu")
    by = {r.name: r for r in rows}
    sizes = {n: c.nbytes for n, c in pm.components.items()}
    assert by["all resident"].h2d_bytes_per_request == 0
    # module strict: every selected component is loaded once per request
    assert by["module dit+text_encoder"].h2d_bytes_per_request == (
        sizes["transformer"] + sizes["transformer_2"] + sizes["text_encoder"])
    assert by["module dit"].h2d_bytes_per_request == sizes["transformer"] + sizes["transformer_2"]
    assert by["module text_encoder"].h2d_bytes_per_request == sizes["text_encoder"]
    assert by["module dit+text_encoder"].resting_bytes == max(
        sizes["transformer"], sizes["text_encoder"]) + sizes["vae"]
    # with room for everything, nothing moves: all resident, or a budget that holds it all
    assert fastest_fitting(rows).h2d_bytes_per_request == 0
    assert isinstance(rows[0], PlanRow)
    assert list(vars(rows[0])) == ["name", "config", "resting_bytes", "peak_bytes",
                                   "h2d_bytes_per_request", "transfer_seconds", "fits",
                                   "pinned_bytes", "pageable_bytes", "disk_bytes", "staging_bytes",
                                   "disk_read_bytes_per_request", "host_fits"]
    # the config of a row is what Omni takes
    for row in rows:
        parse_diffusion_offload_config(row.config["diffusion_offload_config"])
    # at the smallest peak only the candidates with that peak fit; the one that moves
    # the fewest bytes of them is marked
    smallest = min(r.peak_bytes for r in rows)
    tight = plan_model(pm, request, smallest, device_kind="fakegpu")
    assert {r.name for r in tight if r.fits} == {r.name for r in rows if r.peak_bytes == smallest}
    best = fastest_fitting(tight)
    assert best.peak_bytes == smallest
    assert f"*  {best.name}" in format_plan(tight)


def test_fastest_fitting_prefers_less_transfer_then_smaller_peak():
    def row(name, peak, seconds, fits=True):
        return PlanRow(name, {}, 0, peak, int(seconds * 25e9), seconds, fits)

    rows = [row("a", 10, 2.0), row("b", 9, 1.0), row("c", 8, 1.0), row("d", 1, 0.0, fits=False)]
    assert fastest_fitting(rows).name == "c"
    assert fastest_fitting([row("x", 1, 0.0, fits=False)]) is None


def test_plan_errors(tiny_wan):
    with pytest.raises(ValueError, match="device_kind='tpu' is not allowed"):
        plan_offload(tiny_wan, 1 << 30, device_kind="tpu")
    with pytest.raises(ValueError, match="h2d_bandwidth=0 is not allowed"):
        plan_offload(tiny_wan, 1 << 30, h2d_bandwidth=0)
    with pytest.raises(ValueError, match="device_memory=-1 is not allowed"):
        plan_offload(tiny_wan, -1)
    with pytest.raises(ValueError, match="height 33 is not allowed by WanPipeline"):
        plan_offload(tiny_wan, 1 << 30, height=33, device_kind="fakegpu")
    with pytest.raises(ValueError, match="num_frames 6 is not allowed"):
        plan_offload(tiny_wan, 1 << 30, num_frames=6, device_kind="fakegpu")
    with pytest.raises(ModelError, match="no shipped weightless config"):
        plan_offload("nobody/nothing", 1 << 30)


# ---------------------------------------------------------------------- auto and the CLI


def test_parse_refuses_auto_and_points_to_its_users():
    with pytest.raises(ValueError) as err:
        parse_diffusion_offload_config("auto")
    message = str(err.value)
    assert "Omni(model, diffusion_offload_config='auto')" in message
    assert "--diffusion-offload-config auto" in message and "plan_offload" in message


def test_plan_command_prints_the_table(tiny_wan, capsys):
    code = main(["plan", str(tiny_wan), "--device-memory", "15000000B", "--device-kind", "fakegpu",
                 "--height", "32", "--width", "32", "--num-frames", "5", "--steps", "2",
                 "--h2d-bandwidth", "10GB/s"])
    out = capsys.readouterr().out
    assert code == 0
    assert "WanPipeline" in out and "32x32, 5 frames, 2 steps" in out
    assert "fused attention" in out and "10 GB/s" in out
    assert "module dit+text_encoder" in out and "MiB" in out
    assert "* fastest candidate that fits" in out


def test_plan_command_json(tiny_wan, capsys):
    code = main(["plan", str(tiny_wan), "--device-memory", "1GiB", "--device-kind", "fakegpu",
                 "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["device_memory"] == 2**30
    auto = next(r for r in doc["rows"] if r["name"] == doc["auto"])
    assert auto["fits"] and auto["h2d_bytes_per_request"] == 0
    assert doc["request"]["height"] == 32  # make-tiny's default size
    assert {r["name"] for r in doc["rows"]} >= {"all resident", "module dit+text_encoder"}


@pytest.mark.parametrize("argv, message", [
    (["--h2d-bandwidth", "fast"], "--h2d-bandwidth: 'fast' is not a bandwidth"),
    (["--device-memory", "lots"], "--device-memory: 'lots' is not a size"),
    (["--device-kind", "tpu"], "--device-kind: invalid choice: 'tpu'"),
    (["--height", "33"], "--height 33 is not allowed by WanPipeline"),
])
def test_plan_command_errors(tiny_wan, capsys, argv, message):
    code = main(["plan", str(tiny_wan), "--device-kind", "fakegpu", "--device-memory", "1GiB",
                 *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and err.count("\n") == 1


def test_plan_command_without_device_memory_on_a_machine_without_the_device(tiny_wan, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # also on a GPU machine
    assert main(["plan", str(tiny_wan)]) == 2
    assert "--device-memory is required" in capsys.readouterr().err


def test_generate_auto_and_enable_cpu_offload_conflict(capsys):
    code = main(["generate", "--diffusion-offload-config", "auto", "--enable-cpu-offload"])
    assert code == 2
    assert "auto cannot be combined with --enable-cpu-offload" in capsys.readouterr().err


def test_serve_path_builds_an_auto_engine(tiny_wan, fake_device, caplog):
    """``serve --diffusion-offload-config auto``: the parsed flag reaches ``build_omni``
    (the server's engine factory) as ``"auto"``, planned at the model's defaults."""
    import logging

    from diffusion_offload.cli_args import build_parser, parse_config_args
    from diffusion_offload.engine.omni import build_omni

    args = build_parser().parse_args(["serve", str(tiny_wan), "--diffusion-offload-config", "auto",
                                      "--device", "fakegpu"])
    config = parse_config_args(args)
    assert config == "auto"
    with caplog.at_level(logging.INFO, logger="diffusion_offload"):
        engine = build_omni(tiny_wan, config, device="fakegpu", progress=False)
    try:
        assert engine.plan_choice is not None
        assert engine.plan_choice.fits
        assert any("auto picked" in r.getMessage() for r in caplog.records)
    finally:
        engine.close()
