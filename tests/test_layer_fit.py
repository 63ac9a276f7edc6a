"""The fit check in layer mode: trunks + residents + the two largest blocks, from the
safetensors headers; exact on a tiny model, and Wan2.2-A14B (28.6 GB experts) is not
refused on a 24 GiB card."""

from __future__ import annotations

import gc
import json
import shutil
import struct

import pytest
import torch

from diffusion_offload import LayerwiseOffloadBackend, parse_diffusion_offload_config
from diffusion_offload.models.fit import FitError, check_fit, footprint
from diffusion_offload.models.files import inspect_model
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

LAYER = parse_diffusion_offload_config({"mode": "layer", "components": ["dit", "text_encoder"]})
MODULE = parse_diffusion_offload_config({"mode": "module", "components": ["dit", "text_encoder"]})
GIB = 1 << 30


def test_layer_footprint_equals_the_measured_resting_bytes(tmp_path, fake_device):
    path = tiny_pipelines.save("wan2.2", tmp_path / "wan", num_layers=8)
    info = inspect_model(path)
    need = footprint(info, LAYER, None, True)
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path)
    gc.collect()
    base = fa.stats()["allocated_bytes"]
    with LayerwiseOffloadBackend(LAYER, fake_device) as backend:
        backend.enable(pipe)
        at_rest = fa.stats()["allocated_bytes"] - base
        blocks = sorted((c.evictable_bytes for c in backend.components.values() if c.role == "block"), reverse=True)
        # the headers hold no non-persistent buffers (RoPE tables...): those on the
        # device at rest are the only difference
        streamed = {id(m) for c in backend.components.values() if c.role == "block" for m in c.module_ref().modules()}
        extra = sum(
            b.numel() * b.element_size()
            for comp in pipe.components.values() if isinstance(comp, torch.nn.Module)
            for m in comp.modules() if id(m) not in streamed
            for n, b in m._buffers.items() if b is not None and n in m._non_persistent_buffers_set
        )
        assert extra > 0
        assert need.device_bytes + extra == at_rest + blocks[0] + blocks[1]
        assert need.host_bytes == sum(blocks)
        assert len(need.largest_group) == 2
    # the same resting bytes with one DiT block kept resident: one block more on the device
    kept = parse_diffusion_offload_config({**LAYER.to_dict(), "layer_options": {"dit": {"resident_layers": 1}}})
    assert footprint(info, kept, None, True).device_bytes == need.device_bytes + 2 * blocks[-1]


def _sparse_safetensors(path, module: torch.nn.Module, dtype: str = "BF16") -> None:
    """A safetensors file with ``module``'s tensor names and shapes and no data written
    (a sparse file): what the fit check reads is the header only."""
    header: dict = {}
    offset = 0
    size = {"BF16": 2, "F32": 4}
    for name, t in module.state_dict().items():
        nbytes = t.numel() * size[dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        fh.truncate(8 + len(blob) + offset)


def test_wan22_a14b_fits_a_24_gib_card_in_layer_mode_only(tmp_path):
    from diffusion_offload.planner.model import _build_meta, configs_root

    src = configs_root() / "Wan-AI" / "Wan2.2-T2V-A14B-Diffusers"
    dst = tmp_path / "wan22-a14b"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    for name in ("transformer", "transformer_2", "text_encoder", "vae"):
        library, class_name = index[name]
        module = _build_meta(dst / name, library, class_name, torch.bfloat16)
        file = "model.safetensors" if library == "transformers" else "diffusion_pytorch_model.safetensors"
        _sparse_safetensors(dst / name / file, module)
    info = inspect_model(dst)
    expert = info.component_bytes("transformer", 2)
    assert 28.0e9 < expert < 29.2e9  # 14.3e9 parameters in bf16
    need = check_fit(info, LAYER, 2, 24 * GIB, True)
    assert need.device_bytes < 8 * GIB
    with pytest.raises(FitError, match="try --diffusion-offload-config"):
        check_fit(info, MODULE, 2, 24 * GIB, True)


def test_omni_runs_layer_mode_and_matches_the_resident_engine(tmp_path, fake_device):
    import numpy as np

    from diffusion_offload import Omni, SamplingParams

    path = tiny_pipelines.save("wan2.1", tmp_path / "wan21", num_layers=8)
    params = SamplingParams(seed=3, height=32, width=32, num_frames=5, num_inference_steps=1)
    with Omni(str(path), None, device="fakegpu", progress=False) as resident:
        (ref,) = resident.generate("a cat on a mat", params)
    with Omni(str(path), LAYER.to_dict(), device="fakegpu", progress=False) as engine:
        assert isinstance(engine.backend, LayerwiseOffloadBackend)
        (out,) = engine.generate("a cat on a mat", params)
        assert engine.backend.audit() == []
    pixels = [np.stack([np.asarray(f) for f in video]) for video in out.frames]
    want = [np.stack([np.asarray(f) for f in video]) for video in ref.frames]
    assert len(pixels) == len(want) == 1
    np.testing.assert_array_equal(pixels[0], want[0])
    assert out.offload_stats["h2d_bytes"] > 0 and out.offload_stats["d2h_bytes"] == 0
    assert out.offload_stats["prefetches"] > 0
    assert 0 < out.peak_device_memory_bytes < ref.peak_device_memory_bytes
