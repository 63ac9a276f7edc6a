"""Disk-backed loads cost what RAM loads cost (issue 34 item 1): disk arenas, one H2D copy
per staging chunk, a host wait only to reuse a staging buffer, write checks by the arena
sums recorded at the load."""

from __future__ import annotations

import gc
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.core.staging import StagingRing
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

KIND = "wan2.2"
SELECT = ["dit", "text_encoder"]
OFFLOADED = ("transformer", "transformer_2", "text_encoder")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("disk-arenas")
    tiny_pipelines.build(KIND, num_layers=4).save_pretrained(directory)
    return directory


def _load(directory: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _request(pipe) -> np.ndarray:
    kwargs = {**tiny_pipelines.default_call_kwargs(KIND), "num_inference_steps": 2}
    with torch.no_grad():
        out = pipe(prompt="a cat", negative_prompt="blurry", output_type="latent",
                   generator=torch.Generator("cpu").manual_seed(0), **kwargs)
    return out.frames.cpu().double().numpy()


def _offloaded_bytes(pipe) -> int:
    return sum(
        t.numel() * t.element_size()
        for name in OFFLOADED
        for t in [*getattr(pipe, name).parameters(), *getattr(pipe, name).buffers()]
    )


def _steady(directory: Path, mode: str, device: torch.device, budget: int | None):
    """(latents, fake device counters, engine counters) of the third request."""
    pipe = _load(directory)
    cls = ModelLevelOffloadBackend if mode == "module" else LayerwiseOffloadBackend
    kwargs = {} if budget is None else {"host_memory_budget": budget}
    backend = cls({"mode": mode, "components": SELECT}, device, **kwargs)
    backend.enable(pipe)
    try:
        _request(pipe)
        _request(pipe)
        snap = backend.stats.snapshot()
        fa.reset_stats()
        out = _request(pipe)
        s = fa.stats()
        engine = backend.stats.since(snap)
        arenas = {
            id(slot.arena): slot.arena
            for c in backend.components.values() for slot in c.slots
            if slot.arena is not None and slot.arena.on_disk
        }
        singles = [
            slot for c in backend.components.values() for slot in c.slots
            if backend.mover.disk is not None and backend.mover.disk.holds(slot) and slot.arena is None
        ]
        disk = backend.mover.disk
        chunk = disk.ring.chunk if disk is not None else 0
        # every disk-backed slot is read from its file with os.preadv, not through its map
        direct = disk is None or len(disk.file_ranges()) == sum(len(a.slots) for a in arenas.values())
        return out, s, engine, list(arenas.values()), singles, chunk if direct else -1
    finally:
        backend.disable()
        del pipe, backend
        gc.collect()


@pytest.mark.parametrize("mode", ["module", "layer"])
def test_a_disk_backed_load_costs_what_a_ram_load_costs(mode, saved, fake_device):
    """40 % host budget against no budget, same mode, same files: bit-equal latents;
    every disk-backed slot in a disk arena; device ops <= 1.15x; host waits <= the same +
    one per staging-buffer reuse; copies <= the same + one per staging chunk (exactly
    ``ceil(arena bytes / chunk)`` per arena load); no per-tensor fingerprint."""
    budget = int(0.4 * _offloaded_bytes(_load(saved)))
    ref, base, base_engine, _, _, _ = _steady(saved, mode, fake_device, None)
    out, s, e, arenas, singles, chunk = _steady(saved, mode, fake_device, budget)
    assert np.array_equal(out, ref)
    assert arenas and singles == [] and chunk > 0
    assert e.disk_read_bytes > 0 and e.staging_copies > 0
    assert e.cow_bytes == 0 and e.d2h_bytes == base_engine.d2h_bytes  # nothing seen as written
    # each disk arena load: ceil(nbytes / chunk) copies, reads of exactly its slots' bytes
    per_arena = {a.nbytes: math.ceil(a.nbytes / chunk) for a in arenas}
    assert e.staging_copies >= min(per_arena.values())
    assert e.staging_waits <= e.staging_copies
    assert s["device_ops"] <= 1.15 * base["device_ops"], (s["device_ops"], base["device_ops"])
    assert s["host_waits"] <= base["host_waits"] + e.staging_waits, (s["host_waits"], base["host_waits"])
    assert s["transfers"] <= base["transfers"] + e.staging_copies, (s["transfers"], base["transfers"])
    # the checks read no file: arena sums only (as many as without a budget, plus, in
    # module mode, each disk arena's at its load and at its eviction)
    assert e.fingerprints - base_engine.fingerprints <= 2 * len(arenas)
    assert s["races_detected"] == 0


def test_the_ring_packs_sources_at_their_offsets_with_zero_padding(fake_device):
    """Three sources at aligned offsets of a 100-byte destination, a ring of two 24-byte
    buffers: ``ceil(100 / 24) = 5`` H2D copies, 3 buffer reuses (event waits), every
    source's bytes at its offset, the rest zero; ``begin``/``end`` once per source, in
    order, around its bytes; the reads count each source's bytes once."""
    from diffusion_offload.core.platform import platform_for

    ring = StagingRing(platform_for(fake_device), 48, pin=True)
    g = torch.Generator().manual_seed(0)
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (30, 7, 41)]
    offsets = [0, 32, 48]
    dst = torch.full((100,), 7, dtype=torch.uint8).to(fake_device)
    calls: list[tuple[str, int]] = []
    read: list[int] = []
    fa.reset_stats()
    copies = ring.copy(
        [(o, src.numel(), k, None, src) for k, (o, src) in enumerate(zip(offsets, sources))], dst, lambda n, seconds: read.append(n),
        lambda k: calls.append(("begin", k)), lambda k: calls.append(("end", k)),
    )
    s = fa.stats()
    assert copies == 5 and s["transfers"] == 5 and s["h2d_bytes"] == 100
    assert ring.reuses == 3
    assert calls == [("begin", 0), ("end", 0), ("begin", 1), ("end", 1), ("begin", 2), ("end", 2)]
    assert sum(read) == 78
    want = torch.zeros(100, dtype=torch.uint8)
    for off, src in zip(offsets, sources):
        want[off : off + src.numel()] = src
    assert torch.equal(dst.cpu(), want)
    ring.release()


@pytest.mark.parametrize("mode", ["module", "layer"])
def test_a_write_into_a_disk_backed_weight_is_seen_by_the_arena_check(mode, saved, fake_device):
    """An in-place write through ``.data`` into a resident disk-backed weight (peft's
    merge does this) is seen by the disk arena's check at eviction (its sums recorded at
    the load), not lost: its write-back needs a private copy-on-write page, which a budget
    filled to what the host holds has no room for, so the eviction refuses (``HostBudgetError``
    naming the bytes) and the new values stay on the device. The budget is set to what the
    host holds after a request, so no room the plan set aside is left for the write."""
    from diffusion_offload.core.tiers import HostBudgetError

    budget = int(0.4 * _offloaded_bytes(_load(saved)))
    pipe = _load(saved)
    cls = ModelLevelOffloadBackend if mode == "module" else LayerwiseOffloadBackend
    backend = cls({"mode": mode, "components": SELECT}, fake_device, host_memory_budget=budget)
    backend.enable(pipe)
    try:
        _request(pipe)
        disk = backend.mover.disk
        slot = next(s for c in backend.components.values() for s in c.slots
                    if disk.holds(s) and s.arena is not None and c.name.startswith("transformer"))
        w = slot.members[0].obj
        before = w.detach().cpu().clone()
        halved = {}
        s = backend.stats  # the plan's room for check buffers is not all used: fill the budget
        backend.tier_plan.budget = s.pinned_bytes + s.pageable_host_bytes + disk.ring.reserved

        def halve(module, args) -> None:
            if w.device == fake_device and "done" not in halved:
                w.data.mul_(0.5)
                halved["done"] = w.detach().cpu().clone()

        owner = next(m for dit in (pipe.transformer, pipe.transformer_2) for m in dit.modules()
                     if any(p is w for p in m.parameters(recurse=False)))
        hook = owner.register_forward_pre_hook(halve)  # runs with w resident, in both modes
        with pytest.raises(HostBudgetError, match="written disk-backed weight"):
            _request(pipe)
        hook.remove()
        assert "done" in halved and not torch.equal(halved["done"], before)
        assert w.device == fake_device and torch.equal(w.detach().cpu(), halved["done"])
        assert backend.stats.cow_bytes == 0
    finally:
        backend.disable()
        gc.collect()


def _resident_fraction(ranges: list[tuple[str, int, int]]) -> float:
    """The fraction of the pages of ``ranges`` (path, offset, bytes) in the page cache:
    ``mincore`` on a fresh private map of each file (mapping reads nothing; the map is
    writable only so ctypes can take its address, nothing is written)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = resident = 0
    for path, offset, n in ranges:
        lo, hi = offset // page * page, -(-(offset + n) // page) * page
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        hi = min(hi, -(-len(m) // page) * page)
        anchor = ctypes.c_char.from_buffer(m)
        vec = (ctypes.c_ubyte * ((hi - lo) // page))()
        assert libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor) + lo), ctypes.c_size_t(hi - lo), vec) == 0
        total += len(vec)
        resident += sum(v & 1 for v in vec)
        del anchor
        m.close()
    return resident / total


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, int]:
    """A tiny Wan2.1 whose DiT has 4 blocks of 3 MiB feed-forward tensors (page-sized
    tensors: a small model's tensors share their pages)."""
    from test_host_budget import _save_big_wan

    import os

    directory = tmp_path_factory.mktemp("disk-arenas-wide")
    nbytes = _save_big_wan(directory, num_layers=4, ffn_dim=16384)
    os.sync()  # written back: the kernel drops no dirty page (a model on disk is clean)
    return directory, nbytes


@pytest.mark.parametrize("setting", ["drop", "keep"])
def test_page_cache_drop_leaves_no_read_page_in_the_cache(setting, wide, fake_device, caplog):
    """``page_cache="drop"``: after a request the disk-backed bytes' file pages are out of
    the page cache (``POSIX_FADV_DONTNEED`` after each copy; at most 25 % left: the kernel
    skips pages still in another CPU's LRU batch, seen beside other tests); ``"keep"``: at
    least 90 % of them are in it. The start line says which is in force."""
    import logging

    from test_host_budget import _call

    directory, dit_bytes = wide
    pipe = _load(directory)
    backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device,
                                      host_memory_budget=dit_bytes // 4, page_cache=setting)
    with caplog.at_level(logging.INFO, logger="diffusion_offload"):
        backend.enable(pipe)
    try:
        line = {"drop": "dropped after its copy (page_cache='drop')",
                "keep": "kept in the page cache (page_cache='keep')"}[setting]
        assert any(line in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        disk = backend.mover.disk
        ranges = disk.file_ranges()
        assert sum(n for *_, n in ranges) >= dit_bytes // 2
        _call(pipe)
        fraction = _resident_fraction(ranges)
        if setting == "drop":
            assert fraction <= 0.25, fraction
        else:
            assert fraction >= 0.9, fraction
    finally:
        backend.disable()
        gc.collect()


def test_page_cache_refuses_an_unknown_setting(fake_device):
    with pytest.raises(ValueError, match=r"page_cache must be one of 'auto', 'drop', 'keep', got 'never'"):
        ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, fake_device,
                                 host_memory_budget=1 << 20, page_cache="never")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_page_cache_flag_parses_and_refuses_other_values(command, capsys):
    from diffusion_offload.cli_args import build_parser

    required = ["--prompt", "x"] if command == "generate" else ["MODEL"]
    args = build_parser().parse_args([command, *required, "--page-cache", "drop"])
    assert args.page_cache == "drop"
    assert build_parser().parse_args([command, *required]).page_cache is None  # the engine's auto
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, *required, "--page-cache", "never"])
    assert "invalid choice: 'never'" in capsys.readouterr().err
