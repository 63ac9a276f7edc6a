"""The disk tier's lifetime (issue 38 item 5b): a pipeline and backend dropped without
``disable()`` are collected with their device memory, the ``diffusion-offload-reader``
thread exits by itself; ``disable()`` takes the tier's gauges (``cow_bytes``,
``staging_bytes``) out of the stats, and a weight written into its file map under one
``enable`` is planned in RAM at the next (its pages are anonymous memory now)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.core import tiers
from diffusion_offload.testing import fake_accelerator
from diffusion_offload.testing import tiny_pipelines as tp

READER = "diffusion-offload-reader"


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> tuple[Path, int]:
    """A tiny Wan2.1 whose DiT has 4 blocks with 2048-wide feed-forwards (about 1.6 MB),
    saved with ``save_pretrained``; returns the folder and the DiT's bytes."""
    from diffusers import WanTransformer3DModel

    directory = tmp_path_factory.mktemp("reader-wan")
    pipe = tp.build("wan2.1")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe.transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
            out_channels=16, text_dim=32, freq_dim=256, ffn_dim=2048, num_layers=4,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
        )
    pipe.save_pretrained(directory, safe_serialization=True)
    return directory, sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())


def _load(directory: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(directory)  # file-backed safetensors maps
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe) -> torch.Tensor:
    kwargs = tp.default_call_kwargs("wan2.1")
    kwargs.update(num_inference_steps=1, guidance_scale=1.0)
    with torch.no_grad():
        return pipe(prompt="a red fox", output_type="pt", generator=torch.Generator().manual_seed(7),
                    **kwargs).frames


def _backend(mode: str, device: torch.device, budget: int, components=("dit",)):
    cls = ModelLevelOffloadBackend if mode == "module" else LayerwiseOffloadBackend
    return cls({"mode": mode, "components": list(components)}, device, host_memory_budget=budget)


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == READER]


@pytest.mark.parametrize("mode", ["module", "layer"])
def test_a_pipeline_dropped_without_disable_frees_its_device_memory(mode, wan, fake_device):
    directory, dit_bytes = wan
    pipe = _load(directory)
    gc.collect()
    before = fake_accelerator.stats()["allocated_bytes"]
    assert _readers() == []
    backend = _backend(mode, fake_device, dit_bytes // 3)
    backend.enable(pipe)
    assert backend.stats.disk_backed_bytes > 0
    _call(pipe)
    (reader,) = _readers()
    if mode == "layer":  # the trunk stays on the device between requests
        assert fake_accelerator.stats()["allocated_bytes"] > before
    del pipe, backend
    gc.collect()
    reader.join(timeout=5)
    assert not reader.is_alive()
    assert _readers() == []
    assert fake_accelerator.stats()["allocated_bytes"] == before


def test_a_reader_dropped_while_reading_ahead_exits_after_the_read(wan, fake_device):
    """The thread holds the reader while it reads one slot (the slow-disk knob makes that
    read last): dropped meanwhile, the reader is collected once the read finished."""
    directory, dit_bytes = wan
    pipe = _load(directory)
    backend = _backend("layer", fake_device, dit_bytes // 3)
    backend.enable(pipe)
    try:
        _call(pipe)  # the reader learns the order of the blocks
        disk = backend.mover.disk
        reader = disk.reader
        thread = reader._thread
        slot = next(iter(reader._next.values()))
        disk.read_delay = 0.2 / slot.nbytes  # 0.2 s a slot
        with reader._cond:
            reader._queue = [slot]
            reader._cond.notify_all()
        for _ in range(100):  # until the thread took it
            with reader._cond:
                if reader._busy is slot:
                    break
            threading.Event().wait(0.01)
        assert reader._busy is slot
        disk.reader = None  # the owner lets go without close()
        del reader
        gc.collect()
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        backend.disable()


def _disk_weight(pipe, backend) -> torch.nn.Parameter:
    w = pipe.transformer.blocks[3].ffn.net[2].weight
    assert backend.mover.disk.wants([w])
    return w


def test_cow_bytes_start_from_zero_at_each_enable(wan, fake_device):
    """A write on the device into a disk-backed weight, written back at eviction:
    ``cow_bytes`` counts it; ``disable()`` takes it (and the staging ring) out of the
    stats; at the next ``enable`` that weight is planned in RAM (its pages are no longer
    the file's) and ``cow_bytes`` counts only the writes of the new enable; a budget
    without room for it in RAM is refused at ``enable``."""
    directory, dit_bytes = wan
    pipe = _load(directory)
    ref = _load(directory).to(fake_device)
    budget = dit_bytes // 3
    backend = _backend("module", fake_device, budget, ("dit", "text_encoder"))
    backend.enable(pipe)
    s = backend.stats
    w = _disk_weight(pipe, backend)
    w_bytes = w.numel() * w.element_size()
    first = backend.tier_plan
    staging = s.staging_bytes
    assert staging > 0
    backend.tier_plan.budget = s.pinned_total_bytes + s.pageable_host_bytes + backend.mover.disk.ring.reserved + 2 * w_bytes

    def bump(name: str, pending: list[int]):
        def hook(block, args):
            if pending:
                pending.pop()
                with torch.no_grad():
                    for p in (pipe, ref):
                        p.transformer.get_parameter(name).mul_(1.5)
        return hook

    handle = pipe.transformer.blocks[0].register_forward_pre_hook(bump("blocks.3.ffn.net.2.weight", [1]))
    try:
        _call(pipe)
        _call(pipe)  # the text encoder evicts the DiT: the write is written back
    finally:
        handle.remove()
    assert s.cow_bytes == w_bytes
    assert tiers.FileMaps().backing(w) is None  # written: no longer the file's pages
    backend.disable()
    assert (s.cow_bytes, s.staging_bytes) == (0, 0)
    assert _readers() == []
    # after disable() the copies the plan put in RAM are arenas, no longer file maps:
    # with the written weight they are all RAM-only now, and the budget has no room
    ram_only = first.ram_bytes + w_bytes
    with pytest.raises(tiers.HostBudgetError, match=f"cannot hold the {ram_only} bytes of host copies "
                                                    "that cannot be file-backed"):
        backend.enable(pipe)
    assert not backend.is_enabled() and s.cow_bytes == 0

    # room for them, a staging ring and the write checks' buffers
    backend.host_memory_budget = 2 * ram_only + 2 * first.overhead_bytes
    backend.enable(pipe)
    try:
        assert s.cow_bytes == 0
        assert staging == 291216 and s.staging_bytes == backend.tier_plan.staging_bytes > 0
        assert not backend.mover.disk.wants([w])  # planned in RAM now
        plan = backend.tier_plan
        assert plan.ram_only_bytes == ram_only
        assert plan.file_bytes == first.disk_bytes - w_bytes
        assert torch.equal(_call(pipe), _call(ref))
        assert s.cow_bytes == 0
        # a write of the new enable counts from 0
        v = pipe.transformer.blocks[2].ffn.net[2].weight
        assert backend.mover.disk.wants([v])
        backend.tier_plan.budget = s.pinned_total_bytes + s.pageable_host_bytes + backend.mover.disk.ring.reserved + w_bytes
        handle = pipe.transformer.blocks[0].register_forward_pre_hook(bump("blocks.2.ffn.net.2.weight", [1]))
        try:
            _call(pipe)
            _call(pipe)
        finally:
            handle.remove()
        assert s.cow_bytes == v.numel() * v.element_size() == w_bytes
        assert torch.equal(_call(pipe), _call(ref))
    finally:
        backend.disable()
    assert (s.cow_bytes, s.staging_bytes) == (0, 0)
