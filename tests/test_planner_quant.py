"""The planner sizes quantized weights (issue 19): ``--weights-dtype`` for weights quantized
or cast at load, a component's ``quantization_config``, and stored-quantized headers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusion_offload.cli import main
from diffusion_offload.planner.model import load_plan_model
from diffusion_offload.planner.quant import FORMATS, format_from_quantization_config, parse_weights_dtype
from diffusion_offload.testing import tiny_pipelines


def _linear_numels(module: torch.nn.Module) -> list[tuple[int, int]]:
    return [(m.weight.shape[0], m.weight.numel()) for m in module.modules() if isinstance(m, torch.nn.Linear)]


@pytest.fixture(scope="module")
def flux_fp8():
    return load_plan_model("black-forest-labs/FLUX.1-dev", weights_dtype="dit=fp8")


def test_flux_dev_transformer_in_fp8_is_half_its_bf16_size(flux_fp8):
    """The issue's numbers: 11.9 GB (10^9 B) +- 2 % against 23.8 GB in bf16; the text
    encoders keep bf16; every Linear weight is 1 byte plus one float32 scale per row."""
    size = flux_fp8.components["transformer"]
    assert size.weights_format == "fp8"
    assert abs(size.nbytes - 11.9e9) <= 0.02 * 11.9e9, size.nbytes
    bf16 = load_plan_model("black-forest-labs/FLUX.1-dev").components["transformer"]
    assert abs(bf16.nbytes - 23.8e9) <= 0.02 * 23.8e9 and bf16.weights_format is None
    linears = _linear_numels(flux_fp8.modules["transformer"])
    assert bf16.nbytes - size.nbytes == sum(n * 2 - (n + 4 * rows) for rows, n in linears)
    # the streamed blocks shrink by the same rule, block by block
    assert sum(bf16.blocks) - sum(size.blocks) == pytest.approx(bf16.nbytes - size.nbytes, rel=0.01)
    assert flux_fp8.components["text_encoder_2"].weights_format is None
    assert flux_fp8.components["text_encoder_2"].nbytes == load_plan_model(
        "black-forest-labs/FLUX.1-dev").components["text_encoder_2"].nbytes


@pytest.mark.parametrize(("spec", "want"), [
    ("fp8", {"dit": "fp8", "text_encoder": "fp8"}),
    ("dit=fp8,text_encoder=bf16", {"dit": "fp8", "text_encoder": "bf16"}),
    (" transformer_2 = NF4 ", {"transformer_2": "nf4"}),
    ({"dit": "qint8"}, {"dit": "int8"}),
    (None, {}),
])
def test_weights_dtype_specs(spec, want):
    assert {k: f.name for k, f in parse_weights_dtype(spec).items()} == want


@pytest.mark.parametrize(("spec", "message"), [
    ("fp9", "weights format 'fp9' is not allowed; allowed: ['bf16', 'fp16', 'fp32', 'fp8', 'int4', 'int8', 'nf4']"),
    ("dit=fp8,dit=int8", "--weights-dtype names 'dit' twice"),
    ("dit=", "'dit=' is not KEY=FORMAT"),
    ("", "--weights-dtype is empty"),
])
def test_bad_weights_dtype_is_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_weights_dtype(spec)


@pytest.mark.parametrize(("config", "fmt"), [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "nf4"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "int8"),
    ({"quant_method": "torchao", "quant_type": "float8_weight_only"}, "fp8"),
    ({"quant_method": "torchao", "quant_type": {"default": {"_type": "Int8WeightOnlyConfig"}}}, "int8"),
    ({"quant_method": "quanto", "weights_dtype": "int8"}, "int8"),
    ({"quant_method": "gguf"}, None),
])
def test_quantization_config_names_the_format(config, fmt):
    got = format_from_quantization_config(json.dumps({"quantization_config": config}))
    assert (got.name if got else None) == fmt


@pytest.fixture(scope="module")
def tiny_flux(tmp_path_factory):
    return tiny_pipelines.save("flux", tmp_path_factory.mktemp("tiny") / "flux")


def test_a_quantization_config_sizes_the_component_and_stored_quantized_headers_win(tiny_flux, tmp_path):
    """A component whose config asks for nf4 at load is sized in nf4 (an exact rule over
    its Linear weights); once its files hold quantized bytes, their headers give the size
    and the config is not applied again."""
    plain = load_plan_model(tiny_flux).components["transformer"]
    model = tmp_path / "flux"
    shutil.copytree(tiny_flux, model)
    cfg_file = model / "transformer" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    cfg_file.write_text(json.dumps(cfg))
    pm = load_plan_model(model)
    size = pm.components["transformer"]
    assert size.weights_format == "nf4"
    nf4 = FORMATS["nf4"]
    expected = sum(n * 4 - (n // 2 + -(-n // nf4.group) * 4) for _, n in _linear_numels(pm.modules["transformer"]))
    assert plain.nbytes - size.nbytes == expected > 0
    # the same component stored quantized: one weight as uint8 in its file
    (weights,) = sorted((model / "transformer").glob("*.safetensors"))
    tensors = load_file(str(weights))
    key = next(k for k, t in tensors.items() if t.dim() == 2)
    numel = tensors[key].numel()
    tensors[key] = torch.zeros(numel // 2, dtype=torch.uint8)
    save_file(tensors, str(weights))
    stored = load_plan_model(model).components["transformer"]
    assert stored.weights_format is None
    assert plain.nbytes - stored.nbytes == numel * 4 - numel // 2  # float32 -> the stored bytes


def test_plan_json_gives_each_components_size_and_format(tiny_flux, capsys):
    assert main(["plan", str(tiny_flux), "--device-memory", "1GiB", "--json", "--weights-dtype", "dit=int8"]) == 0
    components = json.loads(capsys.readouterr().out)["components"]
    assert components["transformer"]["weights_format"] == "int8"
    assert components["text_encoder"]["weights_format"] is None
    assert main(["plan", str(tiny_flux), "--device-memory", "1GiB", "--weights-dtype", "unet_x=fp8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--weights-dtype names ['unet_x']" in err, err
