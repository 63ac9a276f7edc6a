"""Split-model delegation (SPEC section 5) with the example model in examples/split_model.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from diffusion_offload import ModelLevelOffloadBackend, SupportsModelCpuOffload
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import TEST_DEVICE_TYPE as DEV
from diffusion_offload.testing.pytest_plugin import requires_fake

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from split_model import SplitPipeline  # noqa: E402

DIT = {"mode": "module", "components": ["dit"]}


def _on(module, device_type):
    return all(t.device.type == device_type for t in list(module.parameters()) + list(module.buffers()))


def test_example_is_a_protocol_implementation():
    assert isinstance(SplitPipeline(), SupportsModelCpuOffload)
    assert not isinstance(torch.nn.Linear(2, 2), SupportsModelCpuOffload)


def test_only_the_executing_part_is_resident(fake_device):
    cond = torch.randn(2, 32)
    ref = SplitPipeline()(cond)
    pipe = SplitPipeline()
    ModelLevelOffloadBackend(DIT, fake_device).enable(pipe)
    t = pipe.transformer
    assert _on(t.reasoner, "cpu") and _on(t.generator, "cpu") and _on(pipe.vae, DEV)
    violations = []

    def probe(part, other):
        def hook(mod, args):
            if not _on(part, DEV) or not _on(other, "cpu"):
                violations.append(type(mod).__name__)
        return hook

    for leaf in t.reasoner:
        leaf.register_forward_pre_hook(probe(t.reasoner, t.generator))
    for leaf in t.generator:
        leaf.register_forward_pre_hook(probe(t.generator, t.reasoner))
    for _ in range(2):
        assert torch.equal(pipe(cond), ref)
    assert violations == []


@requires_fake
def test_reactivating_the_active_part_is_free(fake_device):
    pipe = SplitPipeline()
    ModelLevelOffloadBackend(DIT, fake_device).enable(pipe)
    pipe(torch.randn(1, 32), steps=1)
    stats = pipe.transformer.switcher.stats
    before = stats.snapshot()
    fa.reset_stats()
    latents = torch.zeros(1, 32, device=fake_device)
    for _ in range(5):
        pipe.transformer(latents, latents)
    assert stats.since(before).h2d_bytes == 0 and stats.since(before).loads == 0
    assert fa.stats()["synchronizes"] == 0
    generator = sum(p.numel() * 4 for p in pipe.transformer.generator.parameters())
    reasoner = sum(p.numel() * 4 for p in pipe.transformer.reasoner.parameters())
    before = stats.snapshot()
    pipe(torch.randn(1, 32), steps=3)  # reasoner in, generator in: one load each
    delta = stats.since(before)
    assert delta.h2d_bytes == generator + reasoner and delta.loads == 2 and delta.d2h_bytes == 0


def test_transfers_use_supplied_device_and_pinning(fake_device):
    pipe = SplitPipeline()
    ModelLevelOffloadBackend({"mode": "module", "components": ["dit"], "pin_memory": False}, fake_device).enable(pipe)
    assert not any(p.is_pinned() for p in pipe.transformer.parameters())
    pipe2 = SplitPipeline()
    ModelLevelOffloadBackend(DIT, fake_device).enable(pipe2)
    assert all(p.is_pinned() for p in pipe2.transformer.parameters())
    pipe2(torch.randn(1, 32), steps=1)
    assert all(p.device == fake_device for p in pipe2.transformer.generator.parameters())


def test_enable_disable_idempotent_and_disable_removes_context(fake_device):
    pipe = SplitPipeline()
    backend = ModelLevelOffloadBackend(DIT, fake_device)
    backend.enable(pipe)
    switcher = pipe.transformer.switcher
    backend.enable(pipe)
    pipe.enable_omni_model_cpu_offload(device=fake_device, pin_memory=True, use_hsdp=False)
    assert pipe.transformer.switcher is switcher
    backend.disable()
    backend.disable()
    assert pipe.transformer.switcher is None and not backend.is_enabled()
    pipe.disable_omni_model_cpu_offload()


def test_unsatisfiable_selection_rejected_before_setup(fake_device):
    pipe = SplitPipeline()
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["text_encoder"]}, fake_device)
    with pytest.raises(ValueError, match="no text encoder"):
        backend.enable(pipe)
    assert pipe.transformer.switcher is None and not backend.is_enabled()
    assert _on(pipe.transformer, "cpu") and _on(pipe.vae, "cpu")


class Recorder:
    """A protocol implementation that records its calls and can fail."""

    def __init__(self, fail=False):
        self.calls = []
        self.fail = fail

    def enable_omni_model_cpu_offload(self, **kwargs):
        self.calls.append(("enable", kwargs))
        if self.fail:
            raise RuntimeError("model-local setup failed")

    def disable_omni_model_cpu_offload(self):
        self.calls.append(("disable", {}))


def test_backend_passes_settings_and_explicit_selection(fake_device):
    rec = Recorder()
    ModelLevelOffloadBackend(
        {"mode": "module", "components": ["dit"], "pin_memory": False}, fake_device, use_hsdp=True
    ).enable(rec)
    assert rec.calls == [
        ("enable", {"device": fake_device, "pin_memory": False, "use_hsdp": True, "offload_components": ("dit",)})
    ]
    from diffusion_offload import parse_diffusion_offload_config

    legacy = Recorder()
    ModelLevelOffloadBackend(parse_diffusion_offload_config(None, enable_cpu_offload=True), fake_device).enable(legacy)
    assert legacy.calls == [("enable", {"device": fake_device, "pin_memory": True, "use_hsdp": False})]


def test_backend_disables_and_reraises_on_failure(fake_device):
    rec = Recorder(fail=True)
    backend = ModelLevelOffloadBackend(DIT, fake_device)
    with pytest.raises(RuntimeError, match="model-local setup failed"):
        backend.enable(rec)
    assert [c[0] for c in rec.calls] == ["enable", "disable"]
    assert not backend.is_enabled()
