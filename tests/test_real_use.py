"""The ways people really drive diffusers pipelines, on an offloaded tiny Wan2.1 pipeline.

Each test compares against the same operations on an all-resident pipeline and calls
``backend.audit()`` after every step: LoRA load / set_adapters / fuse / unfuse / unload,
diffusers' layerwise casting (``.data`` reassigned on every forward: nothing written
back), ``pipe.to(...)``, a direct call into a child of an offloaded encoder, aliased
Parameters, the pinned-memory cap and the host-memory check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from diffusion_offload import ModelLevelOffloadBackend
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines
from diffusion_offload.testing.pytest_plugin import requires_fake

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}

pytestmark = requires_fake


def _run(pipe) -> np.ndarray:
    kw = tiny_pipelines.default_call_kwargs("wan2.1")
    out = pipe(prompt="a cat on a mat", generator=torch.Generator("cpu").manual_seed(0),
               output_type="np", **kw)
    return np.asarray(out.frames, dtype=np.float64)


def _declared(transformer: nn.Module, text_encoder: nn.Module) -> nn.Module:
    """A pipeline that declares one DiT and one text encoder."""
    from diffusion_offload import SupportsComponentDiscovery

    class Pipe(nn.Module, SupportsComponentDiscovery):
        _dit_modules = ["transformer"]
        _encoder_modules = ["text_encoder"]
        _vae_modules: list = []
        _resident_modules: list = []

    pipe = Pipe()
    pipe.transformer, pipe.text_encoder = transformer, text_encoder
    return pipe


def _pair(device):
    ref = tiny_pipelines.build("wan2.1", 0).to(device)
    pipe = tiny_pipelines.build("wan2.1", 0)
    backend = ModelLevelOffloadBackend(FULL, device)
    backend.enable(pipe)
    return ref, pipe, backend


def test_lora_load_set_adapters_fuse_unfuse_unload_equal_resident(fake_device, lora_state_dict):
    ref, pipe, backend = _pair(fake_device)
    base = _run(ref)
    steps = [
        ("load_lora_weights", lambda p: p.load_lora_weights(
            {k: v.clone() for k, v in lora_state_dict.items()}, adapter_name="a")),
        ("set_adapters 0.5", lambda p: p.set_adapters(["a"], adapter_weights=[0.5])),
        ("fuse_lora", lambda p: p.fuse_lora(lora_scale=1.0)),
        ("unfuse_lora", lambda p: p.unfuse_lora()),
        ("unload_lora_weights", lambda p: p.unload_lora_weights()),
    ]
    outputs = []
    for name, step in steps:
        step(ref)
        step(pipe)
        assert backend.audit() == [], name
        want = _run(ref)
        got = _run(pipe)
        assert backend.audit() == [], name
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=name)
        outputs.append(want)
    assert np.abs(outputs[0] - base).max() > 1e-4  # the LoRA changes the output
    np.testing.assert_allclose(outputs[-1], base, atol=1e-6)  # unloaded: back to the base
    dit_sides = {t.device.type for t in pipe.transformer.parameters()}
    assert len(dit_sides) == 1  # never split across host and device
    backend.disable()


def test_lora_loaded_while_the_dit_is_resident(fake_device, lora_state_dict):
    from diffusion_offload.core.hooks import get_hook

    ref, pipe, backend = _pair(fake_device)
    get_hook(pipe.transformer).activate()  # the DiT is resident (as during denoising)
    assert pipe.transformer.proj_out.weight.device == fake_device
    for p in (ref, pipe):
        p.load_lora_weights({k: v.clone() for k, v in lora_state_dict.items()}, adapter_name="a")
    np.testing.assert_allclose(_run(pipe), _run(ref), atol=1e-6)
    pipe.encode_prompt("a cat", device=fake_device, max_sequence_length=16)  # evicts the DiT
    assert {t.device.type for t in pipe.transformer.parameters()} == {"cpu"}
    assert backend.audit() == []
    backend.disable()


def test_text_encoder_lora_loaded_while_the_encoder_is_evicted(fake_device):
    """Strict module mode, Flux: after a request the text encoders rest on the host;
    diffusers' ``load_lora_weights`` then calls ``text_encoder.to(text_encoder.device)``
    (the host): a no-op that keeps the placement, and the LoRA is used at the next
    request, as on the resident pipeline."""
    pytest.importorskip("peft", reason="LoRA loading needs peft (the `test` extra installs it)")
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    te = inject_adapter_in_model(
        LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "k_proj"], init_lora_weights=False),
        tiny_pipelines.build("flux").text_encoder,
    )
    lora = {f"text_encoder.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(te).items()}
    kwargs = dict(tiny_pipelines.default_call_kwargs("flux"), output_type="np")

    def run(p):
        return np.asarray(p(prompt="a cat", generator=torch.Generator("cpu").manual_seed(0), **kwargs).images)

    ref = tiny_pipelines.build("flux").to(fake_device)
    pipe = tiny_pipelines.build("flux")
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        base = run(pipe)
        assert next(pipe.text_encoder.parameters()).device.type == "cpu"  # evicted
        for p in (ref, pipe):
            p.load_lora_weights({k: v.clone() for k, v in lora.items()}, adapter_name="te")
        want, got = run(ref), run(pipe)
        assert backend.audit() == []
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(want - base).max() > 1e-6  # the LoRA changes the output


def test_layerwise_casting_writes_nothing_back(fake_device):
    import weakref

    ref, pipe, backend = _pair(fake_device)
    for p in (ref, pipe):
        p.transformer.enable_layerwise_casting(
            storage_dtype=torch.float16, compute_dtype=torch.float32
        )
    want = _run(ref)
    payloads = []  # the DiT's device payloads after each forward (reassigned by the casting)

    def remember(module, args, output):
        payloads.extend(weakref.ref(t._inner) for t in module.parameters())

    pipe.transformer.register_forward_hook(remember)
    start = backend.stats.snapshot()
    got = _run(pipe)
    got2 = _run(pipe)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got2, want)
    spent = backend.stats.since(start)
    assert spent.evictions >= 2 and spent.d2h_bytes == 0  # equal bytes: no write-back
    assert backend.audit() == []
    # no stale device copy: the DiT is on the host and none of its device payloads lives
    assert {t.device.type for t in pipe.transformer.parameters()} == {"cpu"}
    assert payloads and all(r() is None for r in payloads)
    backend.disable()


def test_pipe_to_keeps_placement_or_names_disable(fake_device):
    ref, pipe, backend = _pair(fake_device)
    want = _run(ref)
    pipe.to(fake_device)  # keeps the offload placement
    assert {t.device.type for t in pipe.transformer.parameters()} == {"cpu"}
    assert backend.audit() == []
    np.testing.assert_array_equal(_run(pipe), want)
    placement = {n: t.device for n, t in pipe.transformer.named_parameters()}
    with pytest.raises(RuntimeError, match=r"disable\(\)"):
        pipe.to("cpu")
    with pytest.raises(RuntimeError, match=r"disable\(\)"):
        pipe.to(torch.float16)
    assert {n: t.device for n, t in pipe.transformer.named_parameters()} == placement
    assert {t.dtype for t in pipe.transformer.parameters()} == {torch.float32}
    assert backend.audit() == []
    np.testing.assert_array_equal(_run(pipe), want)
    backend.disable()
    pipe.to("cpu")  # after disable the user places modules again
    assert {t.device.type for t in pipe.text_encoder.parameters()} == {"cpu"}


def test_call_below_the_hooked_module_loads_the_component(fake_device):
    ref, pipe, backend = _pair(fake_device)
    ids = torch.randint(0, 8, (1, 6), device=fake_device)
    with torch.no_grad():
        want = ref.text_encoder.encoder(ids).last_hidden_state.cpu()
        for _ in range(2):
            _run(pipe)  # the DiTs evict the text encoder
            assert {t.device.type for t in pipe.text_encoder.parameters()} == {"cpu"}
            got = pipe.text_encoder.encoder(ids).last_hidden_state.cpu()
            assert torch.equal(got, want)
            assert backend.audit() == []
    backend.disable()


def test_aliased_parameters_keep_one_host_copy_and_stay_aliased(fake_device):
    class Dit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            flat = torch.arange(24, dtype=torch.float32)
            self.a = nn.Parameter(flat[:12].view(3, 4))
            self.b = nn.Parameter(flat[12:].view(3, 4))
            self.c = nn.Parameter(flat[4:16].view(3, 4))  # overlaps a and b

        def forward(self, x):
            return x @ self.a.T + x @ self.b.T + x @ self.c.T

    pipe = _declared(Dit(), nn.Linear(4, 4))
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        [slot] = backend.components["transformer"].slots
        assert slot.nbytes == 24 * 4 and backend.stats.pinned_bytes >= 96  # one host copy
        storage = pipe.transformer.a.untyped_storage().data_ptr()  # the DiT's arena
        assert slot.arena is not None and storage == slot.arena.host.data_ptr()
        assert {getattr(pipe.transformer, n).untyped_storage().data_ptr() for n in "abc"} == {storage}
        x = torch.ones(1, 4, device=fake_device)
        with torch.no_grad():
            pipe.transformer(x)
            assert fa.stats()["h2d_bytes"] >= 96
            pipe.transformer.a.data.add_(100.0)  # a .data write through one alias ...
            assert pipe.transformer.c[0, 0].item() == 104.0  # ... is seen by the other
            pipe.text_encoder(x)  # evicts the DiT: written back once
        assert backend.stats.d2h_bytes == 12 * 4 * 2  # a and c changed (they overlap)
        assert pipe.transformer.c.untyped_storage().data_ptr() == storage
        assert pipe.transformer.c[0, 0].item() == 104.0 and pipe.transformer.b[0, 0].item() == 12.0
        assert backend.audit() == []
    assert not backend.is_enabled()


def test_max_pinned_bytes_pins_up_to_the_cap(fake_device):
    pipe = tiny_pipelines.build("wan2.1", 0)
    with ModelLevelOffloadBackend(FULL, fake_device, max_pinned_bytes=50_000) as backend:
        backend.enable(pipe)
        stats = backend.stats
        slots = {id(s): s for c in backend.components.values() if c.selected for s in c.slots}
        pinned = sum(s.nbytes for s in slots.values() if s.pinned)
        pageable = sum(s.nbytes for s in slots.values() if not s.pinned)
        # the cap holds the host copies; the load's check buffers are counted apart
        assert 0 < stats.pinned_bytes == pinned <= 50_000
        assert stats.pageable_host_bytes == pageable > 0
        assert all(t.is_pinned() == backend.components["transformer"].table.slot_of(t).pinned
                   for t in pipe.transformer.parameters())
        _run(pipe)
        assert backend.audit() == []
    with pytest.raises(ValueError, match="max_pinned_bytes"):
        ModelLevelOffloadBackend(FULL, fake_device, max_pinned_bytes=-1)


def test_host_memory_check_refuses_before_anything_moves(fake_device, monkeypatch):
    from diffusion_offload.core import hostmem

    pipe = tiny_pipelines.build("wan2.1", 0).to(fake_device)  # host copies must be made
    placement = {n: t.device for n, t in pipe.transformer.named_parameters()}
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda: 1000)
    fa.reset_stats()
    with pytest.raises(MemoryError, match=r"needs \d+ bytes of host memory.*only 1000 bytes"):
        ModelLevelOffloadBackend(FULL, fake_device).enable(pipe)
    assert fa.stats()["d2h_bytes"] == 0
    assert {n: t.device for n, t in pipe.transformer.named_parameters()} == placement


def test_audit_reports_breaches(fake_device):
    ref, pipe, backend = _pair(fake_device)
    assert backend.audit() == []
    w = pipe.transformer.proj_out.weight
    w.data = w.detach().to(fake_device)  # moved behind the backend's back
    breaches = backend.audit()
    assert any("proj_out.weight" in b and "should be on the host" in b for b in breaches)
    w.data = w.detach().cpu()
    assert backend.audit() == []
    pipe.transformer.proj_out._parameters["extra"] = nn.Parameter(torch.ones(2))  # no hook sees it
    assert any("not managed" in b for b in backend.audit())
    del pipe.transformer.proj_out._parameters["extra"]
    enc = backend.components["text_encoder"]
    enc.resident = True
    backend.components["transformer"].resident = True  # a flag that lies
    breaches = backend.audit()
    assert any("more than one group" in b for b in breaches)
    assert any("should be on the device" in b for b in breaches)
    backend.components["transformer"].resident = False
    backend.disable()


def test_gguf_parameters_keep_subclass_and_quant_type(fake_device):
    gguf = pytest.importorskip("gguf", reason="GGUF weights need the gguf package (the `test` extra)")
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    q8 = gguf.GGMLQuantizationType.Q8_0
    w = np.random.RandomState(0).randn(64, 64).astype(np.float32)
    dit = GGUFLinear(64, 64, bias=False, compute_dtype=torch.float32)
    dit.weight = GGUFParameter(torch.from_numpy(gguf.quantize(w, q8)), quant_type=q8)
    pipe = _declared(dit, nn.Linear(64, 64))
    x = torch.randn(2, 64)
    with torch.no_grad():
        ref = pipe.transformer(x)
    w = pipe.transformer.weight
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        for _ in range(2):
            with torch.no_grad():
                out = pipe.transformer(x.to(fake_device))
                assert isinstance(w, GGUFParameter) and w.device == fake_device and w.quant_type == q8
                assert torch.equal(out.cpu(), ref)
                pipe.text_encoder(x.to(fake_device))  # evicts the DiT
            assert type(w) is GGUFParameter and w.device.type == "cpu" and w.quant_type == q8
            assert w.dtype == torch.uint8 and w.is_pinned()
            assert backend.stats.d2h_bytes == 0 and backend.audit() == []


def test_vae_decodes_without_the_dits(fake_device):
    """Strict mode: the selected DiTs are evicted before ``vae.decode`` (free: unmodified),
    and the H2D bytes per request do not grow (the next text encoder would evict them)."""
    pipe = tiny_pipelines.build("wan2.2", 0)
    ref = tiny_pipelines.build("wan2.2", 0).to(fake_device)
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    seen = []

    def at_decode(module, args):
        seen.append({t.device.type for n in ("transformer", "transformer_2")
                     for t in getattr(pipe, n).parameters()})

    pipe.vae.decoder.register_forward_pre_hook(at_decode)
    kw = tiny_pipelines.default_call_kwargs("wan2.2")

    def run(p):
        out = p(prompt="a fox", generator=torch.Generator("cpu").manual_seed(0), output_type="np", **kw)
        return np.asarray(out.frames, dtype=np.float64)

    want = run(ref)
    run(pipe)  # the first request also loads what enable() left on the host
    weights = sum(c.nbytes for n, c in backend.components.items()
                  if n in ("text_encoder", "transformer", "transformer_2"))
    for _ in range(2):
        before = backend.stats.snapshot()
        np.testing.assert_array_equal(run(pipe), want)
        spent = backend.stats.since(before)
        assert spent.h2d_bytes == weights and spent.d2h_bytes == 0
        assert backend.audit() == []
    assert seen and all(s == {"cpu"} for s in seen)
    backend.disable()


# --------------------------------------------------------------- regressions from a review


def _toy(device):
    from diffusion_offload.testing.toy import ToyPipeline

    g = torch.Generator().manual_seed(3)
    ids, image = torch.randint(0, 32, (2, 5), generator=g), torch.randn(2, 16, generator=g)
    ref = ToyPipeline().to(device)(ids, image, device=device)
    pipe = ToyPipeline()
    return pipe, (lambda: pipe(ids, image, device=device)), ref


def test_components_sharing_one_storage_keep_separate_slots(fake_device):
    pipe, run, ref = _toy(fake_device)
    params = list(pipe.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # every weight in one buffer
    offset = 0
    with torch.no_grad():
        for p in params:
            p.data = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        for comp in backend.components.values():
            assert all(s.owners == {comp.name} for s in comp.slots), comp.name
        assert backend.audit() == []
        assert torch.equal(run(), ref) and backend.audit() == []
        assert {t.device.type for t in pipe.transformer.parameters()} == {"cpu"}


def test_moving_a_child_of_an_evicted_dit_is_refused(fake_device):
    pipe, run, ref = _toy(fake_device)
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        with pytest.raises(RuntimeError, match=r"disable\(\)"):
            pipe.transformer.blocks[0].to(fake_device)
        pipe.transformer.blocks[0].to("cpu")  # to the side it is on: fine
        pipe.transformer.blocks[0].to(torch.float32)  # a dtype conversion: fine
        assert backend.audit() == [] and torch.equal(run(), ref)


def test_a_submodule_added_after_enable_loads_its_component(fake_device):
    pipe, run, _ = _toy(fake_device)
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        pipe.transformer.extra = nn.Linear(16, 16)  # on the host, DiT evicted
        run()  # the DiT ran: the new submodule is adopted (and gets its hooks)
        run()
        assert {t.device.type for t in pipe.transformer.parameters()} == {"cpu"}
        with torch.no_grad():
            out = pipe.transformer.extra(torch.ones(1, 16, device=fake_device))
        assert out.device == fake_device and backend.components["transformer"].resident
        assert backend.audit() == []


def test_a_deleted_pipeline_frees_its_device_memory_while_the_backend_lives(fake_device):
    import gc

    gc.collect()
    before = fa.stats()["allocated_bytes"]
    pipe, run, _ = _toy(fake_device)
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    run()
    del pipe, run
    gc.collect()
    assert fa.stats()["allocated_bytes"] == before
    assert backend.modules == {}
    pipe2, run2, ref2 = _toy(fake_device)
    backend.enable(pipe2)  # its pipeline is gone: the backend can take another
    assert torch.equal(run2(), ref2) and backend.audit() == []
    backend.disable()


def test_disable_inside_offload_component_moves_nothing(fake_device):
    from diffusion_offload import offload_component

    pipe, run, ref = _toy(fake_device)
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    with offload_component(pipe.transformer):
        backend.disable()
    assert {t.device for t in pipe.transformer.parameters()} == {fake_device}


def test_rebinding_a_weight_to_another_view_of_its_storage_while_evicted(fake_device):
    pipe, run, _ = _toy(fake_device)
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        w = pipe.transformer.blocks[0].fc1.weight  # (32, 16), on the host
        with torch.no_grad():
            w.data = w.data.reshape(16, 32).t()  # same shape, new strides, same storage
        want = w.detach().clone()
        run()
        assert torch.equal(w.detach().cpu(), want) and backend.audit() == []


def test_touching_a_weight_without_changing_its_bytes_writes_nothing_back(fake_device):
    pipe, run, _ = _toy(fake_device)
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        enc = pipe.encoders["text"]
        start = backend.stats.snapshot()
        with torch.no_grad():
            enc.block.fc1.weight.add_(0.0)
            enc.block.fc2.weight.copy_(enc.block.fc2.weight.clone())
            enc.block.fc1.bias.clamp_(-float("inf"), float("inf"))
        run()  # the DiTs evict the text encoder
        assert backend.stats.since(start).d2h_bytes == 0
