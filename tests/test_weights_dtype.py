"""The planner sizes quantized components at their stored width (issue 19): ``--weights-dtype``
("I will quantize at load") and a component config's ``quantization_config``."""

from __future__ import annotations

import json

import pytest

from diffusion_offload.cli import main
from diffusion_offload.planner.model import load_plan_model
from diffusion_offload.planner.widths import config_width, parse_weights_dtype
from diffusion_offload.testing import tiny_pipelines

FLUX = "black-forest-labs/FLUX.1-dev"


def test_parse_weights_dtype():
    assert parse_weights_dtype(None) == {} and parse_weights_dtype("") == {}
    assert parse_weights_dtype("fp8") == {"dit": "fp8", "text_encoder": "fp8", "encoder": "fp8"}
    assert parse_weights_dtype("dit=fp8, text_encoder=bf16") == {"dit": "fp8", "text_encoder": "bf16"}
    assert parse_weights_dtype({"transformer": "int8"}) == {"transformer": "int8"}
    with pytest.raises(ValueError, match=r"weights_dtype dit='fp7' is not allowed; allowed widths: \['fp32'"):
        parse_weights_dtype("dit=fp7")
    with pytest.raises(ValueError, match="names 'dit' twice"):
        parse_weights_dtype("dit=fp8,dit=int8")
    with pytest.raises(ValueError, match="entry 'fp8' is not allowed"):
        parse_weights_dtype("dit=fp8,fp8")


def test_quantization_config_gives_the_stored_width():
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    assert config_width({"quantization_config": bnb}) == "nf4"
    assert config_width({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}) == "int8"
    assert config_width({"quantization_config": {"quant_method": "torchao", "quant_type": "float8wo_e4m3"}}) == "fp8"
    assert config_width({"quantization_config": {"quant_method": "torchao", "quant_type": "int8wo"}}) == "int8"
    assert config_width({"quantization_config": {"quant_method": "quanto", "weights_dtype": "int8"}}) == "int8"
    assert config_width({"quantization_config": {"quant_method": "gguf"}}) is None
    assert config_width({}) is None and config_width(None) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-wan2.1")
    tiny_pipelines.save("wan2.1", path)
    return str(path)


def test_weights_dtype_narrows_the_named_components_and_their_blocks(tiny):
    plain = load_plan_model(tiny, dtype="bfloat16").components
    dit = load_plan_model(tiny, dtype="bfloat16", weights_dtype="dit=fp8").components
    every = load_plan_model(tiny, dtype="bfloat16", weights_dtype="fp8").components
    assert dit["transformer"].weights_dtype == "fp8" and plain["transformer"].weights_dtype is None
    assert dit["transformer"].nbytes < 0.75 * plain["transformer"].nbytes
    assert dit["text_encoder"].nbytes == plain["text_encoder"].nbytes  # not named: as loaded
    assert every["text_encoder"].nbytes < plain["text_encoder"].nbytes
    assert every["vae"].nbytes == plain["vae"].nbytes  # "fp8" alone: DiTs and encoders
    assert len(dit["transformer"].blocks) == len(plain["transformer"].blocks)
    assert all(a < b for a, b in zip(dit["transformer"].blocks, plain["transformer"].blocks))


def test_plan_json_gives_flux_dit_at_fp8_half_its_bf16_size(capsys):
    """FLUX.1-dev's transformer: 23.8 GB in bf16 (the shipped config's 11.9e9 parameters,
    ``test_planner``), 11.9 GB with ``--weights-dtype dit=fp8`` (10**9 B, within 2 %)."""
    assert main(["plan", FLUX, "--json", "--device-memory", "24GiB", "--weights-dtype", "dit=fp8"]) == 0
    out = json.loads(capsys.readouterr().out)
    transformer = out["components"]["transformer"]
    assert transformer["weights_dtype"] == "fp8" and abs(transformer["bytes"] - 11.9e9) <= 0.02 * 11.9e9
    assert abs(transformer["params"] * 2 - 23.8e9) <= 0.02 * 23.8e9  # its bf16 size
    assert out["components"]["text_encoder_2"]["weights_dtype"] is None


def test_plan_refuses_a_bad_weights_dtype(capsys):
    assert main(["plan", "no/such-model", "--json", "--device-memory", "24GiB", "--weights-dtype", "dit=fp7"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--weights-dtype" in err[0] and "'fp7'" in err[0] and "fp8" in err[0]


def test_unknown_key_is_named(tiny):
    with pytest.raises(ValueError, match=r"weights_dtype names \['unet'\]"):
        load_plan_model(tiny, weights_dtype="unet=fp8")


def test_a_checkpoints_quantization_config_sizes_it(tmp_path):
    """A tiny Wan2.1 folder whose transformer config says bitsandbytes 4-bit: its float
    weights count at nf4 (half a byte and an absmax byte per 64 weights) for Linears."""
    tiny_pipelines.save("wan2.1", tmp_path)
    plain = load_plan_model(str(tmp_path), dtype="float32").components["transformer"]
    config = tmp_path / "transformer" / "config.json"
    data = json.loads(config.read_text())
    data["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    config.write_text(json.dumps(data))
    quantized = load_plan_model(str(tmp_path), dtype="float32").components["transformer"]
    assert quantized.weights_dtype == "nf4" and quantized.nbytes < 0.5 * plain.nbytes
