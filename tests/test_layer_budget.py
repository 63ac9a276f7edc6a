"""Layer mode with ``device_memory_budget`` (issue 18, item 3) and diffusers' First Block
Cache under both modes (item 4), on the fake accelerator: exact H2D bytes from the
engine's stats, outputs equal to the same run without offload, 0 races.

``bench/layer_budget.py`` runs the same checks at the issue's bench size.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.core.discovery import SupportsComponentDiscovery
from diffusion_offload.core.policy import BudgetTooSmallError, keep_blocks
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines
from diffusion_offload.testing.toy import SyntheticDiT


@pytest.fixture(autouse=True)
def _no_races(fake_device):
    fa.reset_stats()
    yield
    assert fa.stats()["races_detected"] == 0


# ------------------------------------------------------------------ the choice


def test_keep_blocks_minimises_h2d_first_then_spreads_ties():
    te = [("text_encoder", i, 300) for i in range(2)]
    a = [("a", i, 100) for i in range(8)]
    b = [("b", i, 100) for i in range(8)]
    blocks = te + a + b
    buffer = 600  # the two largest left streaming: the text encoder's
    # b runs 6 times a request, a twice: b's blocks first, spread over its stack
    assert keep_blocks(blocks, {"text_encoder": 2, "a": 2, "b": 6}, buffer + 300) == [11, 14, 16]
    # equal calls: round-robin over the components, evenly over each one's positions
    assert keep_blocks(blocks, {"text_encoder": 2, "a": 4, "b": 4}, buffer + 600) == [3, 6, 8, 11, 14, 16]
    # one byte short of the sixth block: five
    assert len(keep_blocks(blocks, {"text_encoder": 2, "a": 4, "b": 4}, buffer + 599)) == 5
    # a block that never runs is never kept; room for everything keeps everything that runs
    assert keep_blocks(blocks, {"a": 1}, 10**9) == list(range(2, 10))
    assert keep_blocks(blocks, {"text_encoder": 1, "a": 1, "b": 1}, 10**9) == list(range(18))
    # keeping the large blocks shrinks the double buffer to two of a's 100-byte blocks:
    # 600 + 100 kept + 200 streaming fits 900, a second one of a's would not
    assert keep_blocks(te + a[:4], {"text_encoder": 9, "a": 1}, 900) == [0, 1, 4]
    assert keep_blocks(blocks, {"a": 1}, 599) == []


# ----------------------------------------------------- the budget on two synthetic DiTs


class _TwoDiTs(nn.Module, SupportsComponentDiscovery):
    """Two synthetic DiTs: ``transformer`` runs once a request, ``transformer_2`` thrice."""

    _dit_modules: ClassVar[list[str]] = ["transformer", "transformer_2"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.transformer = SyntheticDiT(num_blocks=4, seed=1)
        self.transformer_2 = SyntheticDiT(num_blocks=4, seed=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.transformer(x)
        for _ in range(3):
            x = self.transformer_2(x)
        return x


def _requests(pipe: nn.Module, backend: LayerwiseOffloadBackend, x: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Run ``n`` requests; the last one's output and H2D bytes."""
    for _ in range(n):
        start = backend.stats.snapshot()
        with torch.no_grad():
            out = pipe(x).cpu()
        spent = backend.stats.since(start)
    return out, spent.h2d_bytes


def test_a_budget_keeps_the_most_called_blocks_and_cuts_h2d_by_exactly_their_calls(fake_device):
    x = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(0)).to(fake_device)
    ref = _TwoDiTs().to(fake_device)
    with torch.no_grad():
        expected = ref(x).cpu()
    del ref
    config = {"mode": "layer", "components": ["dit"]}
    pipe = _TwoDiTs()
    with LayerwiseOffloadBackend(config, fake_device) as probe:
        probe.enable(pipe)
        block = probe.streamer.sequences["transformer"][0].nbytes
        budget = probe.fixed_bytes + (2 + 2) * block  # the double buffer + 2 blocks
    with LayerwiseOffloadBackend(config, fake_device, device_memory_budget=budget) as backend:
        backend.enable(pipe)
        assert backend.budget == budget
        out, h2d = _requests(pipe, backend, x, 3)  # 2 warm-ups, then steady
        assert torch.equal(out, expected)
        assert backend.audit() == []
        assert backend.stats.fallback_loads == 0
        # transformer_2 runs 3 times a request, transformer once: both kept blocks are
        # transformer_2's, spread over its stack
        assert backend.kept == {"transformer_2": ["blocks.1", "blocks.3"]}
        assert backend.fixed_bytes + sum(b.nbytes for b in backend.streamer.on_device()) <= budget
    # without a budget every call streams all 4 blocks of its DiT (tests/test_layer_mode.py);
    # the kept blocks no longer stream, at each of their 3 calls
    assert h2d == (1 * 4 + 3 * 4) * block - 2 * 3 * block


def test_a_budget_below_the_trunks_and_two_blocks_is_refused_before_anything_moves(fake_device):
    pipe = _TwoDiTs()
    config = {"mode": "layer", "components": ["dit"]}
    with LayerwiseOffloadBackend(config, fake_device) as probe:
        probe.enable(pipe)
        block = probe.streamer.sequences["transformer"][0].nbytes
        smallest = probe.fixed_bytes + 2 * block
    backend = LayerwiseOffloadBackend(config, fake_device, device_memory_budget=smallest - 1)
    allocated = fa.stats()["allocated_bytes"]
    placed = [p.device for p in pipe.parameters()]
    with pytest.raises(BudgetTooSmallError, match=f"smallest workable budget of {smallest} bytes") as err:
        backend.enable(pipe)
    assert "the two largest streamed blocks" in str(err.value)
    assert not backend.is_enabled() and fa.stats()["allocated_bytes"] == allocated
    assert [p.device for p in pipe.parameters()] == placed
    with pytest.raises(ValueError, match="device_memory_budget='lots' is not allowed"):
        LayerwiseOffloadBackend(config, fake_device, device_memory_budget="lots")
    with pytest.raises(TypeError, match="device_memory_budget must be an int"):
        LayerwiseOffloadBackend(config, fake_device, device_memory_budget=1.5)


# ----------------------------------------------------------------------- First Block Cache

KIND = "wan2.1"
LAYERS = 3  # head, one middle block, tail: a cached forward skips 2
STEPS = 3  # per guidance branch the first forward computes, the later ones may be cached
THRESHOLD = 0.2


def _call(pipe) -> torch.Tensor:
    kwargs = {**tiny_pipelines.default_call_kwargs(KIND), "num_inference_steps": STEPS}
    out = pipe(prompt="a cat on a mat", negative_prompt="blurry", output_type="latent",
               generator=torch.Generator("cpu").manual_seed(0), **kwargs)
    return out.frames.cpu()


def _cache(pipe) -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=THRESHOLD))


@pytest.fixture(scope="module")
def cached_reference():
    """The same cache without offload: the latents, and (DiT forwards, block bodies run)."""
    device = fa.install()
    pipe = tiny_pipelines.build(KIND, num_layers=LAYERS).to(device)
    pipe.set_progress_bar_config(disable=True)
    _cache(pipe)
    counts = _count_bodies(pipe)
    out = _call(pipe)
    return out, dict(counts)


def _count_bodies(pipe) -> dict[str, int]:
    """Counts, updated as the pipeline runs: DiT forwards, and per block its calls and
    the runs of its body (its ``attn1``: a skipped block never calls it)."""
    counts = {"forwards": 0}

    def bump(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1

    pipe.transformer.register_forward_pre_hook(lambda m, a: bump("forwards"))
    for i, block in enumerate(pipe.transformer.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: bump(f"call {i}"))
        block.attn1.register_forward_pre_hook(lambda m, a, i=i: bump(f"body {i}"))
    return counts


@pytest.mark.parametrize(
    "order", ["cache after enable", pytest.param("cache before enable", marks=pytest.mark.full)]
)
def test_first_block_cache_in_layer_mode_streams_only_the_blocks_that_run(order, cached_reference, fake_device):
    reference, ref_counts = cached_reference
    cached = ref_counts["forwards"] - ref_counts[f"body {LAYERS - 1}"]  # forwards the cache cut short
    assert cached >= 2  # the request exercises the cache
    pipe = tiny_pipelines.build(KIND, num_layers=LAYERS)
    pipe.set_progress_bar_config(disable=True)
    if order == "cache before enable":
        _cache(pipe)
    backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit", "text_encoder"]}, fake_device)
    with backend:
        backend.enable(pipe)
        if order == "cache after enable":
            _cache(pipe)
        # learn the order; a second warm-up for the exact count: the first request's
        # last call guesses its successor and its prefetch is dropped in the second
        for _ in range(2 if order == "cache after enable" else 1):
            _call(pipe)
        counts = _count_bodies(pipe)
        start = backend.stats.snapshot()
        out = _call(pipe)
        spent = backend.stats.since(start)
        wasted_bytes = spent.wasted_bytes
        assert torch.equal(out, reference)
        assert counts == ref_counts
        seq = {c: {b.name: b.nbytes for b in s} for c, s in backend.streamer.sequences.items()}
        dit = seq["transformer"]
        block = dit["blocks.1"]
        assert len(set(dit.values())) == 1  # equal blocks
        # without a cache every call streams every block (tests/test_layer_mode.py)
        streamed_all = 2 * sum(seq["text_encoder"].values()) + counts["forwards"] * sum(dit.values())
        skipped = sum(counts[f"call {i}"] - counts[f"body {i}"] for i in range(LAYERS)) * block
        assert skipped == cached * (LAYERS - 1) * block
        # the skipped blocks do not stream; the one prefetched during each cached
        # forward's head block is the only waste, counted (stats.wasted_bytes)
        # the issue's bound: the skipped blocks' bytes, less at most one block per cached forward
        assert streamed_all - skipped < spent.h2d_bytes <= streamed_all - skipped + cached * block
        if order == "cache after enable":
            assert spent.h2d_bytes == streamed_all - skipped + wasted_bytes
            assert 0 < wasted_bytes <= cached * block and wasted_bytes % block == 0
            assert spent.wasted_prefetches == wasted_bytes // block
        assert spent.fallback_loads == 0 and spent.d2h_bytes == 0
        assert backend.audit() == []


def test_first_block_cache_in_module_mode_equals_the_cache_without_offload(cached_reference, fake_device):
    reference, _ = cached_reference
    for before in (False,):  # before enable: bench/layer_budget.py
        pipe = tiny_pipelines.build(KIND, num_layers=LAYERS)
        pipe.set_progress_bar_config(disable=True)
        if before:
            _cache(pipe)
        with ModelLevelOffloadBackend({"mode": "module", "components": ["dit", "text_encoder"]}, fake_device) as backend:
            backend.enable(pipe)
            if not before:
                _cache(pipe)
            assert torch.equal(_call(pipe), reference)
            assert backend.audit() == []
