"""Layer mode you can trust (issue 17): the situations a review and a fault sweep found,
each a test that failed before its fix.

Toy models (``testing.toy.SyntheticDiT``) on the fake device keep these fast; the tiny
diffusers pipelines check the schedule and fp8 layerwise casting end to end.
"""

from __future__ import annotations

import gc
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch import nn

from diffusion_offload import LayerwiseOffloadBackend, SupportsComponentDiscovery
from diffusion_offload.core.policy import StageOutOfMemoryError
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines
from diffusion_offload.testing.pytest_plugin import requires_fake
from diffusion_offload.testing.toy import SyntheticDiT, SyntheticPipeline
from diffusion_offload.core.transfer import Mover

pytestmark = requires_fake

LAYER_DIT = {"mode": "layer", "components": ["dit"]}
LAYER = {"mode": "layer", "components": ["dit", "text_encoder"]}


OneDiT = SyntheticPipeline  # a pipeline of one synthetic DiT (``transformer``)


def _races() -> int:
    return fa.stats()["races_detected"]


def _x(device=None) -> torch.Tensor:
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    return x if device is None else x.to(device)


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def _reference(fake_device, mutate=None, **kwargs) -> torch.Tensor:
    ref = OneDiT(**kwargs)
    if mutate is not None:
        mutate(ref)
    ref.to(fake_device)
    with torch.no_grad():
        return ref(_x(fake_device)).cpu()


def _at_rest(backend: LayerwiseOffloadBackend) -> list[str]:
    """Streamed blocks on the device outside a forward (at most the carried prefetch)."""
    s = backend.streamer
    return [b.name for b in s.on_device() if b is not s.prefetched]


# -- 1. a write to a carried prefetch -------------------------------------------------


def test_a_write_to_the_carried_prefetch_is_written_back_when_it_is_dropped(fake_device):
    """The prefetch carried after a forward (blocks.0) is written to (peft's
    ``p.data += delta``), then the next forward starts elsewhere: dropping it writes the
    change back; a later forward that runs blocks.0 uses it."""
    pipe = OneDiT(num_blocks=4)
    delta = 0.25
    with LayerwiseOffloadBackend(LAYER_DIT, fake_device) as backend:
        backend.enable(pipe)
        with torch.no_grad():
            pipe(_x(fake_device))
            pipe(_x(fake_device))
            carried = backend.streamer.prefetched
            assert carried is not None and carried.name == "blocks.0"
            weight = pipe.transformer.blocks[0].fc1.weight
            assert weight.device == fake_device
            weight.data += delta
            written = weight.detach().cpu().clone()
            before = backend.stats.snapshot()
            pipe.transformer.block_order = (1, 2, 3)
            pipe(_x(fake_device))  # drops the carried blocks.0
            assert weight.device.type == "cpu" and torch.equal(weight.detach(), written)
            assert backend.stats.since(before).d2h_bytes == weight.numel() * weight.element_size()
            pipe.transformer.block_order = (0, 1, 2, 3)
            out = pipe(_x(fake_device)).cpu()
        assert backend.audit() == []

    def mutate(ref: OneDiT) -> None:
        with torch.no_grad():
            ref.transformer.blocks[0].fc1.weight += delta

    assert torch.equal(out, _reference(fake_device, mutate, num_blocks=4))
    assert _races() == 0


# -- 2. a prefetch in flight after a forward returns ------------------------------------


@pytest.mark.parametrize("action", ["read", "in-place write", "replace"])
def test_what_the_caller_does_between_requests_is_ordered_after_the_carried_copy(action, fake_device):
    """After a forward the next forward's first block sits on the device, its H2D copy
    queued on the copy stream; a read, an in-place write or a replacement of its weight
    on the caller's stream must be ordered after that copy (no RaceError)."""
    pipe = OneDiT(num_blocks=4)
    with LayerwiseOffloadBackend(LAYER_DIT, fake_device) as backend:
        backend.enable(pipe)
        with torch.no_grad():
            pipe(_x(fake_device))
            weight = pipe.transformer.blocks[0].fc1.weight
            assert backend.streamer.prefetched is not None and weight.device == fake_device
            if action == "read":
                float(weight.sum())
            elif action == "in-place write":
                weight.mul_(1.0)
            else:
                weight.data = weight.data.clone()
            pipe(_x(fake_device))
        assert backend.audit() == []
    assert _races() == 0


# -- 3. layerwise casting replaces prefetched weights -----------------------------------


def _run_np(pipe, kind: str) -> np.ndarray:
    kwargs = dict(tiny_pipelines.default_call_kwargs(kind))
    kwargs.setdefault("output_type", "np")
    out = pipe(prompt="a cat on a mat", generator=torch.Generator("cpu").manual_seed(0), **kwargs)
    arr = getattr(out, "frames", None)
    return np.asarray(arr if arr is not None else out.images, dtype=np.float64)


def test_fp8_layerwise_casting_in_layer_mode_is_race_free_and_exact(fake_device):
    """diffusers' ``enable_layerwise_casting`` replaces each prefetched fp8 weight by a
    float32 copy and drops the fp8 device tensor, which the copy stream allocated: the
    handed-over block is recorded on the compute stream, so that free is safe."""

    def fp8(pipe):
        pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
        return pipe

    ref = fp8(tiny_pipelines.build("wan2.1")).to(fake_device)
    want = _run_np(ref, "wan2.1")
    del ref
    gc.collect()
    pipe = fp8(tiny_pipelines.build("wan2.1"))
    with LayerwiseOffloadBackend(LAYER, fake_device) as backend:
        backend.enable(pipe)
        outs = [_run_np(pipe, "wan2.1") for _ in range(2)]
        assert backend.stats.d2h_bytes == 0
        assert backend.audit() == []
    assert all(np.abs(o - want).max() <= 1e-6 for o in outs)
    assert torch.float8_e4m3fn in {p.dtype for p in pipe.transformer.parameters()}
    assert _races() == 0


# -- 5. an interrupted release ----------------------------------------------------------


class _FailingEvict:
    """``Mover.evict`` that raises ``exc`` on its ``k``-th call (once), moving nothing."""

    def __init__(self, monkeypatch, k: int, exc: BaseException) -> None:
        self.k, self.calls, self.exc = k, 0, exc
        self.real = Mover.evict
        monkeypatch.setattr(Mover, "evict", self)

    def __get__(self, mover, owner):
        return lambda *a, **kw: self(mover, *a, **kw)

    def __call__(self, mover, *args, **kwargs):
        self.calls += 1
        if self.calls == self.k:
            raise self.exc
        return self.real(mover, *args, **kwargs)


@pytest.mark.parametrize("kind", [KeyboardInterrupt, RuntimeError], ids=["ctrl-c", "error"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_an_interrupted_release_strands_no_block(k, kind, fake_device, monkeypatch):
    exc = kind("injected")  # made here: a shared instance would keep its traceback (and the model) alive
    ref = _reference(fake_device, num_blocks=4)
    pipe = OneDiT(num_blocks=4)
    with LayerwiseOffloadBackend(LAYER_DIT, fake_device) as backend:
        backend.enable(pipe)
        with torch.no_grad():
            pipe(_x(fake_device))
            failing = _FailingEvict(monkeypatch, k, exc)
            with pytest.raises(kind):
                pipe(_x(fake_device))
            exc.__traceback__ = None
            monkeypatch.setattr(Mover, "evict", failing.real)
            assert backend.audit() == []
            assert len(backend.streamer.on_device()) <= 1  # at most the carried block
            backend.streamer.max_on_device = 0
            for _ in range(2):
                assert torch.equal(pipe(_x(fake_device)).cpu(), ref)
        assert backend.streamer.max_on_device <= 2
        assert backend.audit() == [] and _at_rest(backend) == []
    assert _races() == 0


# -- 6. disable with a carried prefetch -------------------------------------------------


def test_after_disable_the_carried_block_can_be_read_and_freed_safely(fake_device):
    pipe = OneDiT(num_blocks=4)
    backend = LayerwiseOffloadBackend(LAYER_DIT, fake_device)
    backend.enable(pipe)
    with torch.no_grad():
        pipe(_x(fake_device))
    weight = pipe.transformer.blocks[0].fc1.weight
    assert weight.device == fake_device  # the carried block stays where it is
    backend.disable()
    with torch.no_grad():
        weight.sum()
        weight.data = torch.zeros_like(weight.data)  # frees the copy stream's allocation
    assert _races() == 0


# -- 9. nested streamed blocks ----------------------------------------------------------


class _Nested(nn.Module):
    """A block whose forward calls another streamed block (``inner``) or itself."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.inner: list[nn.Module] = []  # not a submodule: a sibling of the block list

    def forward(self, h: torch.Tensor, depth: int = 0) -> torch.Tensor:
        h = h + torch.tanh(self.fc(h))
        for other in self.inner:
            h = other(h)
        if depth:
            h = self(h, depth - 1)
        return h + self.fc.bias


class NestedDiT(nn.Module):
    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, recurse: bool) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.proj = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Nested(8) for _ in range(4))
        self.recurse = recurse
        if not recurse:
            self.blocks[1].inner.append(self.blocks[3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        for i, blk in enumerate(self.blocks):
            h = blk(h, 2 if self.recurse and i == 2 else 0)
        return h


class NestedPipe(OneDiT):
    def __init__(self, recurse: bool) -> None:
        nn.Module.__init__(self)
        self.transformer = NestedDiT(recurse)


@pytest.mark.parametrize("recurse", [False, True], ids=["calls-a-sibling", "calls-itself"])
def test_a_block_that_calls_a_streamed_block_stays_resident_while_it_runs(recurse, fake_device):
    ref = NestedPipe(recurse).to(fake_device)
    with torch.no_grad():
        want = ref(_x(fake_device)).cpu()
    pipe = NestedPipe(recurse)
    with LayerwiseOffloadBackend(LAYER_DIT, fake_device) as backend:
        backend.enable(pipe)
        with torch.no_grad():
            outs = [pipe(_x(fake_device)).cpu() for _ in range(3)]
        assert backend.audit() == [] and _at_rest(backend) == []
    assert all(torch.equal(o, want) for o in outs)
    assert _races() == 0


# -- 10. the schedule follows what runs -------------------------------------------------


@pytest.mark.parametrize("placeholders", [False, True], ids=["unused-blocks", "placeholders"])
def test_blocks_that_never_run_are_never_loaded(placeholders, fake_device):
    """Six blocks run, two listed after them never do (unused weights, or parameterless
    placeholders as on a pipeline-parallel rank): after the first forward the next
    forward's first block is the carried prefetch and each forward copies exactly the
    six blocks that run."""

    def build() -> OneDiT:
        p = OneDiT(num_blocks=8, width=16, order=tuple(range(6)))
        if placeholders:
            for i in (6, 7):
                p.transformer.blocks[i] = nn.Identity()
        return p

    ref = build().to(fake_device)
    with torch.no_grad():
        want = ref(_x(fake_device)).cpu()
    pipe = build()
    tensor_bytes = sum(_nbytes(pipe.transformer.blocks[i]) for i in range(6))
    with LayerwiseOffloadBackend(LAYER_DIT, fake_device) as backend:
        backend.enable(pipe)
        # what streams: each block's arena (its 16-byte alignment padding, under 1 %)
        run_bytes = sum(backend.streamer.sequences["transformer"][i].nbytes for i in range(6))
        assert tensor_bytes <= run_bytes <= 1.01 * tensor_bytes
        with torch.no_grad():
            assert torch.equal(pipe(_x(fake_device)).cpu(), want)
            # the first forward guessed the container's order; at its end the carried
            # block is the next forward's first, not the never-run blocks.6
            assert backend.streamer.prefetched.name == "blocks.0"
            for _ in range(3):
                before = backend.stats.snapshot()
                assert torch.equal(pipe(_x(fake_device)).cpu(), want)
                spent = backend.stats.since(before)
                assert spent.h2d_bytes == run_bytes and spent.fallback_loads == 0
        assert backend.audit() == []
    assert _races() == 0


@pytest.mark.parametrize("output_type", ["latent", "np"])
def test_identical_requests_move_identical_bytes_from_the_second_on(output_type, fake_device):
    """Tiny Wan2.2 (two expert DiTs, 8 blocks each, and the text encoder streamed), four
    identical 2-step CFG requests: from the second on each moves exactly the sum over
    the calls of the bytes of the blocks that ran."""
    pipe = tiny_pipelines.build("wan2.2", num_layers=8)
    with LayerwiseOffloadBackend(LAYER, fake_device) as backend:
        backend.enable(pipe)
        ran = [0]
        modules = {n: m for n, m in pipe.components.items() if isinstance(m, nn.Module)}
        for comp, seq in backend.streamer.sequences.items():
            for block in seq:
                sub = modules[comp].get_submodule(block.name)
                sub.register_forward_pre_hook(lambda m, a, n=block.nbytes: ran.__setitem__(0, ran[0] + n))
        kwargs = dict(tiny_pipelines.default_call_kwargs("wan2.2"))
        kwargs.update(num_inference_steps=2, negative_prompt="blurry", output_type=output_type)
        moved, expected = [], []
        for _ in range(4):
            ran[0] = 0
            before = backend.stats.snapshot()
            pipe(prompt="a fox", generator=torch.Generator("cpu").manual_seed(0), **kwargs)
            moved.append(backend.stats.since(before).h2d_bytes)
            expected.append(ran[0])
        assert backend.audit() == []
    assert moved[1:] == expected[1:] and len(set(moved[1:])) == 1, (moved, expected)
    assert _races() == 0


# -- 11. prefetch=False and a model that reads .device ---------------------------------


class _Enc(nn.Module):
    """A text encoder whose ``device`` is its first parameter's, which is in a block."""

    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["layers"]

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))  # registered first
        self.embed = nn.Embedding(32, 16)
        self.pos = nn.Embedding(64, 16)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1]).to(self.device))
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return h


class _EncPipe(SupportsComponentDiscovery):
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self) -> None:
        self.text_encoder = _Enc()
        self.transformer = SyntheticDiT(num_blocks=3, width=16, in_dim=16)

    def __call__(self, ids: torch.Tensor, device) -> torch.Tensor:
        with torch.no_grad():
            return self.transformer(self.text_encoder(ids.to(device))).cpu()


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_model_reading_device_from_a_block_parameter_works_without_prefetch(prefetch, fake_device):
    ids = torch.randint(0, 32, (1, 7), generator=torch.Generator().manual_seed(0))
    ref = _EncPipe()
    ref.text_encoder.to(fake_device)
    ref.transformer.to(fake_device)
    want = ref(ids, fake_device)
    pipe = _EncPipe()
    with LayerwiseOffloadBackend(LAYER, fake_device, prefetch=prefetch) as backend:
        backend.enable(pipe)
        outs = [pipe(ids, fake_device) for _ in range(2)]
        assert backend.audit() == []
    assert all(torch.equal(o, want) for o in outs)
    assert _races() == 0


# -- 12. out of device memory -----------------------------------------------------------


def _peak_without_prefetch(fake_device) -> int:
    pipe = OneDiT(num_blocks=4)
    with LayerwiseOffloadBackend(LAYER_DIT, fake_device, prefetch=False) as backend:
        backend.enable(pipe)
        with torch.no_grad():
            pipe(_x(fake_device))
            gc.collect()
            fa.reset_peak()
            pipe(_x(fake_device))
        peak = fa.stats()["peak_bytes"]
    del pipe, backend
    gc.collect()
    return peak


def test_an_oom_with_prefetch_retries_the_forward_synchronously(fake_device):
    """Capacity = the peak of a forward without prefetch: with prefetch (two blocks) it
    runs out, drops the prefetch, empties the cache and reruns the forward without
    prefetch, exactly."""
    ref = _reference(fake_device, num_blocks=4)
    gc.collect()
    cap = _peak_without_prefetch(fake_device)
    pipe = OneDiT(num_blocks=4)
    x = _x(fake_device)
    with LayerwiseOffloadBackend(LAYER_DIT, fake_device) as backend:
        backend.enable(pipe)
        fa.set_capacity(cap)
        try:
            with torch.no_grad():
                outs = [pipe(x).cpu() for _ in range(2)]
        finally:
            fa.set_capacity(None)
        assert backend.streamer.retries >= 1
        assert backend.audit() == [] and _at_rest(backend) == []
    assert all(torch.equal(o, ref) for o in outs)
    assert _races() == 0


def test_a_second_oom_raises_stage_out_of_memory_naming_stage_and_block(fake_device):
    pipe = OneDiT(num_blocks=4)
    x = _x(fake_device)
    with LayerwiseOffloadBackend(LAYER_DIT, fake_device) as backend:
        backend.enable(pipe)
        gc.collect()
        fa.set_capacity(fa.stats()["allocated_bytes"] + _nbytes(pipe.transformer.blocks[0]) // 2)
        try:
            with pytest.raises(StageOutOfMemoryError, match=r"stage 'transformer'.*block 'blocks\.0'.*bytes"):
                with torch.no_grad():
                    pipe(x)
        finally:
            fa.set_capacity(None)
        assert backend.audit() == [] and backend.streamer.on_device() == []
        with torch.no_grad():
            assert torch.equal(pipe(x).cpu(), _reference(fake_device, num_blocks=4))
    assert _races() == 0


# -- 2. LoRA between requests, with the carried block on the device ---------------------


def test_lora_load_fuse_unfuse_unload_between_layer_mode_requests(fake_device, lora_state_dict):
    """diffusers' LoRA API between requests while a block is carried on the device (its
    copy just queued): every step equals the resident pipeline, no race, audit clean."""
    ref = tiny_pipelines.build("wan2.1", 0).to(fake_device)
    pipe = tiny_pipelines.build("wan2.1", 0)
    steps = [
        ("load_lora_weights", lambda p: p.load_lora_weights(
            {k: v.clone() for k, v in lora_state_dict.items()}, adapter_name="a")),
        ("fuse_lora", lambda p: p.fuse_lora(lora_scale=1.0)),
        ("unfuse_lora", lambda p: p.unfuse_lora()),
        ("unload_lora_weights", lambda p: p.unload_lora_weights()),
    ]
    with LayerwiseOffloadBackend(LAYER, fake_device) as backend:
        backend.enable(pipe)
        _run_np(pipe, "wan2.1")
        for name, step in steps:
            assert backend.streamer.prefetched is not None, name  # a block is carried
            step(ref)
            step(pipe)
            want, got = _run_np(ref, "wan2.1"), _run_np(pipe, "wan2.1")
            np.testing.assert_allclose(got, want, atol=1e-6, err_msg=name)
            assert backend.audit() == [], name
    assert _races() == 0
