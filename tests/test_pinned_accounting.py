"""Every pinned byte counted (issue 34 item 4): ``stats.pinned_total_bytes`` (the pinned
host copies, ``pinned_bytes``, plus ``pinned_overhead_bytes``) equals the pinned
host memory the fake device sees alive (``torch.fakegpu.pinned_host_bytes``: each
registration's bytes, each caching-allocator block rounded up to a power of two, the
pinned result of every non-blocking copy to the host), in module mode, layer mode and
under a host budget (staging ring, disk tier fingerprints), with in-place pinning and
without it (every buffer then comes from ``pin_memory()`` and its rounding is counted);
and it stays within the host budget, and within the host memory available when that is
less than the copies (shared case weights/12)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.core import checksum, hostmem
from diffusion_offload.testing import tiny_pipelines

KIND = "wan2.2"
SELECT = ["dit", "text_encoder"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("pinned-accounting")
    tiny_pipelines.build(KIND, num_layers=4).save_pretrained(directory)
    return directory


def _load(directory: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(directory)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _request(pipe) -> torch.Tensor:
    kwargs = {**tiny_pipelines.default_call_kwargs(KIND), "num_inference_steps": 2}
    with torch.no_grad():
        out = pipe(prompt="a cat", negative_prompt="blurry", output_type="latent",
                   generator=torch.Generator("cpu").manual_seed(0), **kwargs)
    return out.frames.cpu()


def _pinned_outside_weights() -> int:
    """Pinned bytes alive in the process, less the shared checksum weights (each backend
    counts those whole, whoever made them)."""
    gc.collect()
    return torch.fakegpu.pinned_host_bytes() - checksum.pinned_weights_bytes()


def _offloaded_bytes(pipe) -> int:
    return sum(t.numel() * t.element_size()
               for name in ("transformer", "transformer_2", "text_encoder")
               for t in [*getattr(pipe, name).parameters(), *getattr(pipe, name).buffers()])


@pytest.mark.parametrize("in_place", [True, False], ids=["registered", "pin_memory"])
@pytest.mark.parametrize("budget", [None, 0.4], ids=["no-budget", "budget-40%"])
@pytest.mark.parametrize("mode", ["module", "layer"])
def test_pinned_bytes_are_every_pinned_byte_alive(mode, budget, in_place, saved, fake_device, monkeypatch):
    if not in_place:  # a driver that refuses cudaHostRegister: every pin is a pin_memory() copy
        monkeypatch.setattr(type(torch.fakegpu), "host_register", staticmethod(lambda ptr, n: False))
    pipe = _load(saved)
    limit = None if budget is None else int(budget * _offloaded_bytes(pipe))
    before = _pinned_outside_weights()
    cls = ModelLevelOffloadBackend if mode == "module" else LayerwiseOffloadBackend
    kwargs = {} if limit is None else {"host_memory_budget": limit}
    backend = cls({"mode": mode, "components": SELECT}, fake_device, **kwargs)
    backend.enable(pipe)
    try:
        for _ in range(2):
            _request(pipe)
        s = backend.stats
        alive = _pinned_outside_weights() - before
        assert alive == s.pinned_total_bytes - s.shared_pinned_bytes
        assert s.shared_pinned_bytes == checksum.pinned_weights_bytes() > 0
        # the buffers: the shared weights, the ring under a budget, the sums a module-mode
        # load records (layer mode compares with sums kept on the host)
        ring = backend.mover.disk.ring.charged if limit is not None else 0
        assert s.pinned_overhead_bytes >= s.shared_pinned_bytes + ring
        if mode == "module":
            assert s.pinned_overhead_bytes > s.shared_pinned_bytes + ring
        if limit is not None:
            chunk = backend.mover.disk.ring.chunk
            assert backend.tier_plan.disk_bytes > 0 and s.staging_bytes == 2 * chunk
            # registered: the ring's bytes; a pin_memory() block each: a power of two
            assert ring == 2 * (chunk if in_place else hostmem.caching_host_bytes(chunk))
            if in_place:  # the plan's room for the ring and the check buffers holds
                assert s.pinned_total_bytes + s.pageable_host_bytes <= limit
    finally:
        backend.disable()


def test_caching_host_bytes_is_the_power_of_two_above():
    assert [hostmem.caching_host_bytes(n) for n in (0, 1, 2, 3, 4096, 4097, 3 << 20)] == [
        0, 1, 2, 4, 4096, 8192, 4 << 20]


def test_host_buffer_charges_what_it_pins_and_gives_it_back_when_freed(fake_device, monkeypatch):
    from diffusion_offload.core.platform import platform_for

    platform = platform_for(fake_device)
    charged: list[int] = []
    gc.collect()
    base = torch.fakegpu.pinned_host_bytes()
    buf = hostmem.host_buffer(1000, torch.int32, platform, True, charged.append)
    assert buf.is_pinned() and charged == [4000]  # registered in place: its bytes exactly
    assert torch.fakegpu.pinned_host_bytes() - base == 4000
    del buf
    gc.collect()
    assert charged == [4000, -4000] and torch.fakegpu.pinned_host_bytes() == base
    monkeypatch.setattr(type(torch.fakegpu), "host_register", staticmethod(lambda ptr, n: False))
    buf = hostmem.host_buffer(1000, torch.int32, platform, True, charged.append)
    assert buf.is_pinned() and charged[-1] == 4096  # a pin_memory() block: a power of two
    assert torch.fakegpu.pinned_host_bytes() - base == 4096
    plain = hostmem.host_buffer(1000, torch.int32, platform, False, charged.append)
    assert not plain.is_pinned() and charged[-1] == 4096  # not pinned: nothing charged


@pytest.mark.parametrize("budget", [None, 0.4], ids=["no-budget", "budget-40%"])
@pytest.mark.parametrize("mode", ["module", "layer"])
def test_disable_takes_the_host_copies_out_of_the_gauges(mode, budget, saved, fake_device):
    """``disable()`` leaves the host copies to the pipeline: they leave the host gauges, so
    an ``enable`` after it counts them once, not twice (the gauges were kept, and a second
    enable counted 426,880 pinned bytes of a 217,536-byte model)."""
    pipe = _load(saved)
    limit = None if budget is None else int(budget * _offloaded_bytes(pipe))
    cls = ModelLevelOffloadBackend if mode == "module" else LayerwiseOffloadBackend
    kwargs = {} if limit is None else {"host_memory_budget": limit}
    backend = cls({"mode": mode, "components": SELECT}, fake_device, **kwargs)
    s = backend.stats

    def host() -> tuple[int, int, int]:
        return s.pinned_bytes, s.pageable_host_bytes, s.disk_backed_bytes

    backend.enable(pipe)
    first = host()
    assert first[0] > 0 and (first[2] > 0) == (limit is not None)
    backend.disable()
    assert host() == (0, 0, 0) and s.staging_bytes == 0
    if limit is not None:
        return  # the RAM tier's copies are arenas now, not file maps: the same budget cannot
        # hold them again (tests/test_disk_reader_lifetime.py)
    backend.enable(pipe)
    try:
        # the same copies again: the arenas (pinned in place) are adopted as they are
        assert host()[0] + host()[1] + host()[2] == sum(first)
        _request(pipe)
    finally:
        backend.disable()
    assert host() == (0, 0, 0)


@pytest.mark.parametrize("in_place", [True, False], ids=["registered", "pin_memory"])
def test_pinning_stays_within_the_available_host_memory(in_place, saved, fake_device, monkeypatch):
    """The host reports half the offloaded bytes available (shared case weights/12): every
    pinned byte (copies, padding, rounding, the sums and weights of the checks) stays within
    it, the host copies are still exactly the offloaded bytes (the rest pageable, one copy
    each), and a request gives the all-resident output."""
    pipe = _load(saved)
    want = _request(pipe.to(fake_device))
    pipe = _load(saved)
    weights = _offloaded_bytes(pipe)
    half = weights // 2
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda: half)
    if not in_place:
        monkeypatch.setattr(type(torch.fakegpu), "host_register", staticmethod(lambda ptr, n: False))
    backend = ModelLevelOffloadBackend({"mode": "module", "components": SELECT}, fake_device)
    shared_before = checksum.pinned_weights_bytes()  # pinned before: outside what is available
    with pytest.warns(RuntimeWarning, match=f"pinning at most .* the host has {half} bytes available"):
        backend.enable(pipe)
    try:
        s = backend.stats
        assert s.pinned_bytes + s.pageable_host_bytes == weights
        assert s.pinned_bytes > 0 and s.pageable_host_bytes > 0
        # past the pinning room the rest of a component is one pageable arena, not one
        # arena per tensor (each with write-check sums of its own: 4x its bytes, pinned)
        for weights_of in backend.components.values():
            arenas = {id(slot.arena): slot.arena for slot in weights_of.slots if slot.arena is not None}
            assert sum(not a.pinned for a in arenas.values()) <= 1
        assert torch.equal(_request(pipe), want)
        gc.collect()
        own = s.pinned_total_bytes - s.shared_pinned_bytes
        assert own + checksum.pinned_weights_bytes() - shared_before <= half
    finally:
        backend.disable()
