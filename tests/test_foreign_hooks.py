"""Other libraries' placement hooks are refused at ``enable()`` before anything moves
(issue 19): accelerate's ``_hf_hook`` (device_map, dispatch_model, diffusers' model /
sequential CPU offload) and diffusers' group offloading; layerwise casting and cache hooks
in the same registry are accepted."""

from __future__ import annotations

import pytest
import torch

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.core.foreign import ForeignHookError
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines
from diffusion_offload.testing.pytest_plugin import requires_fake

pytestmark = requires_fake

MODULE = {"mode": "module", "components": ["dit", "text_encoder"]}
LAYER = {"mode": "layer", "components": ["dit", "text_encoder"]}
BACKENDS = [(ModelLevelOffloadBackend, MODULE), (LayerwiseOffloadBackend, LAYER)]
IDS = ["module", "layer"]


def _placement(pipe) -> list[tuple[str, str, int]]:
    """Every tensor of every component: name, device type, data pointer."""
    out = []
    for cname in ("transformer", "text_encoder", "vae"):
        for tname, t in list(getattr(pipe, cname).named_parameters()) + list(getattr(pipe, cname).named_buffers()):
            out.append((f"{cname}.{tname}", t.device.type, t.data_ptr()))
    return out


def _refused(backend_cls, config, pipe, device) -> str:
    before, allocated = _placement(pipe), fa.stats()["allocated_bytes"]
    backend = backend_cls(config, device)
    with pytest.raises(ForeignHookError) as info:
        backend.enable(pipe)
    assert not backend.is_enabled()
    assert _placement(pipe) == before  # nothing moved, nothing re-pointed
    assert fa.stats()["allocated_bytes"] == allocated
    assert fa.stats()["h2d_bytes"] == 0
    return str(info.value)


@pytest.mark.parametrize(("backend_cls", "config"), BACKENDS, ids=IDS)
def test_accelerate_hook_on_a_submodule_is_refused_before_anything_moves(backend_cls, config, fake_device):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    pipe = tiny_pipelines.build("wan2.1")
    add_hook_to_module(pipe.transformer.blocks[1].ffn, AlignDevicesHook(execution_device="cpu"))
    msg = _refused(backend_cls, config, pipe, fake_device)
    assert "component 'transformer'" in msg and "blocks.1.ffn" in msg and "_hf_hook" in msg
    assert "pipe.remove_all_hooks()" in msg
    assert "accelerate.hooks.remove_hook_from_module(pipe.transformer, recurse=True)" in msg


def test_device_mapped_pipeline_is_told_reset_device_map(fake_device):
    from accelerate import dispatch_model

    pipe = tiny_pipelines.build("wan2.1")
    dispatch_model(pipe.text_encoder, device_map={"": "cpu"}, force_hooks=True)
    pipe.hf_device_map = {"text_encoder": "cpu"}
    msg = _refused(ModelLevelOffloadBackend, MODULE, pipe, fake_device)
    assert "component 'text_encoder'" in msg and "pipe.reset_device_map()" in msg
    # the advice works: once removed, offload runs
    pipe.reset_device_map()
    with ModelLevelOffloadBackend(MODULE, fake_device) as backend:
        backend.enable(pipe)
        assert backend.audit() == []


def test_group_offloading_is_refused_before_anything_moves(fake_device):
    pipe = tiny_pipelines.build("wan2.1")
    pipe.transformer.enable_group_offload(
        onload_device=fake_device, offload_device=torch.device("cpu"), offload_type="block_level",
        num_blocks_per_group=1,
    )
    msg = _refused(LayerwiseOffloadBackend, LAYER, pipe, fake_device)
    assert "component 'transformer'" in msg and "group_offloading" in msg
    assert "remove_hook" in msg or "disable_group_offload" in msg


@pytest.mark.parametrize(("backend_cls", "config"), BACKENDS, ids=IDS)
def test_layerwise_casting_and_cache_hooks_are_accepted(backend_cls, config, fake_device):
    from diffusers import FirstBlockCacheConfig

    pipe = tiny_pipelines.build("wan2.1")
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.0))
    with backend_cls(config, fake_device) as backend:
        backend.enable(pipe)
        assert backend.is_enabled() and backend.audit() == []
