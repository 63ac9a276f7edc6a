"""In-place pinning registrations (``hostmem``) follow their storages' lifetimes."""

from __future__ import annotations

import re
import threading

import torch

from diffusion_offload.core import hostmem, staging, tiers


class _Platform:
    """A platform stub that records registrations; ``on_register`` runs inside them."""

    def __init__(self) -> None:
        self.device = torch.device("cuda", 0)  # only its type keys the registrations
        self.live: set[int] = set()
        self.on_register = None

    def host_register(self, ptr: int, nbytes: int) -> bool:
        if self.on_register is not None:
            self.on_register()
        self.live.add(ptr)
        return True

    def host_unregister(self, ptr: int) -> None:
        self.live.discard(ptr)


def test_registration_lives_as_long_as_the_storage():
    platform = _Platform()
    t = torch.ones(1000)
    view = t[10:20]
    assert hostmem.pin_in_place(platform, t.untyped_storage())
    assert hostmem.pin_in_place(platform, view.untyped_storage())  # already: no second one
    assert platform.live == {t.data_ptr()}
    del t
    assert platform.live  # the view keeps the storage, and so the registration
    del view
    assert platform.live == set()


def test_a_storage_freed_while_registering_another_does_not_deadlock():
    platform = _Platform()
    holder = [torch.ones(1000)]
    assert hostmem.pin_in_place(platform, holder[0].untyped_storage())
    # freeing the first storage runs its unregister finalizer inside the second registration
    platform.on_register = holder.clear
    second = torch.ones(2000)
    done = threading.Event()

    def register() -> None:
        hostmem.pin_in_place(platform, second.untyped_storage())
        done.set()

    worker = threading.Thread(target=register, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done.is_set(), "pin_in_place deadlocked on a finalizer run inside it"
    assert platform.live == {second.data_ptr()}


def test_unpin_in_place_undoes_a_registration():
    platform = _Platform()
    t = torch.ones(100)
    assert hostmem.pin_in_place(platform, t.untyped_storage())
    hostmem.unpin_in_place(platform, t.untyped_storage())
    assert platform.live == set()
    assert hostmem.pin_in_place(platform, t.untyped_storage())  # and it can register again


import warnings  # noqa: E402

import pytest  # noqa: E402

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend  # noqa: E402
from diffusion_offload.testing.toy import SyntheticPipeline, ToyPipeline  # noqa: E402


def _nbytes(*modules: torch.nn.Module) -> int:
    """Bytes of the modules' parameters and buffers (non-persistent ones included)."""
    tensors = {id(t): t for m in modules for t in [*m.parameters(), *m.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _setup(mode: str):
    """A pipeline, its call on the device and the bytes of its host copies in ``mode``."""
    if mode == "module":
        ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(3))
        image = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
        make = lambda: ToyPipeline(dim=64)  # noqa: E731
        call = lambda p, dev: p(ids, image, device=dev)  # noqa: E731
        offloaded = lambda p: _nbytes(p.transformer, p.transformer_2)  # noqa: E731
    else:
        x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(3))
        make = lambda: SyntheticPipeline(num_blocks=6)  # noqa: E731
        call = lambda p, dev: p(x.to(dev)).cpu()  # noqa: E731
        offloaded = lambda p: _nbytes(*p.transformer.blocks)  # noqa: E731
    return make, call, offloaded


@pytest.mark.parametrize("mode", ["module", "layer"])
@pytest.mark.parametrize("in_place", [True, False])
def test_pinning_stops_at_the_host_memory_available(mode, in_place, fake_device, monkeypatch):
    """With the host reporting half the offloaded weights as available, at most that many
    bytes are pinned (the rest pageable, one warning naming both numbers), host copies are
    exactly 1.0x the offloaded weights, and the output equals the all-resident one (shared
    case weights/12); in place or not (a driver that refuses ``cudaHostRegister``)."""
    make, call, offloaded = _setup(mode)
    with torch.no_grad():
        want = call(make().to(fake_device), fake_device)
    cls = ModelLevelOffloadBackend if mode == "module" else LayerwiseOffloadBackend
    config = {"mode": mode, "components": ["dit"]}
    control = cls(config, fake_device)
    kept = make()  # hooks hold modules weakly: keep it alive
    control.enable(kept)
    # the host has room: everything pinned (the arenas' padding is pinned overhead)
    weights = control.stats.pinned_bytes
    assert control.stats.pageable_host_bytes == 0
    control.disable()
    del kept
    # within 4 bytes a tensor of the weights' own bytes (storage spans: a scalar view
    # of a larger storage has its span copied)
    pipe = make()
    assert 0 <= weights - offloaded(pipe) <= 4 * sum(1 for _ in pipe.parameters())
    half = weights // 2
    monkeypatch.setattr(hostmem, "available_host_bytes", lambda: half)
    if not in_place:
        monkeypatch.setattr(type(torch.fakegpu), "host_register", staticmethod(lambda ptr, n: False), raising=False)
    backend = cls(config, fake_device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.enable(pipe)
    try:
        s = backend.stats
        assert 0 < s.pinned_bytes and s.pinned_total_bytes <= half  # every pinned byte within it
        assert s.pinned_bytes + s.pageable_host_bytes == weights
        pins = [str(w.message) for w in caught if "pinning at most" in str(w.message)]
        assert len(pins) == 1 and re.fullmatch(
            rf"pinning at most (\d+) of the {weights} bytes of host copies: the host has {half} "
            r"bytes available \(MemAvailable\), (\d+) of them kept for the copies' pinned buffers; "
            r"the rest stays in pageable memory \(synchronous host->device copies\)", pins[0])
        assert backend.max_pinned_bytes is None and backend.mover.max_pinned_bytes is None
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(call(pipe, fake_device), want)
        assert backend.audit() == []
    finally:
        backend.disable()


# ----------------------------------------------------------------------------- chunked pinning


def test_a_storage_larger_than_the_chunk_is_registered_in_pieces(monkeypatch):
    """``PIN_CHUNK`` lowered to 64 KiB: a 200,000-byte storage is registered in pieces of
    at most 64 KiB, cut at multiples of it (page-aligned), covering it exactly; all are
    undone with the storage."""
    chunk = 64 << 10
    monkeypatch.setattr(hostmem, "PIN_CHUNK", chunk)
    sizes: dict[int, int] = {}
    platform = _Platform()
    register = platform.host_register
    platform.host_register = lambda ptr, n: sizes.__setitem__(ptr, n) or register(ptr, n)
    t = torch.empty(200_000, dtype=torch.uint8)
    ptr = t.data_ptr()
    assert hostmem.pin_in_place(platform, t.untyped_storage())
    assert max(sizes.values()) <= chunk and sum(sizes.values()) == 200_000
    assert min(sizes) == ptr and all(p % chunk == 0 for p in sizes if p != ptr)
    assert len(sizes) == -(-(ptr % chunk + 200_000) // chunk)
    assert platform.live == set(sizes)
    del t
    assert platform.live == set()


def test_a_refused_piece_undoes_the_others(monkeypatch):
    monkeypatch.setattr(hostmem, "PIN_CHUNK", 64 << 10)
    platform = _Platform()
    calls = []

    def register(ptr: int, n: int) -> bool:
        calls.append(ptr)
        if len(calls) == 2:
            return False
        platform.live.add(ptr)
        return True

    platform.host_register = register
    t = torch.empty(300_000, dtype=torch.uint8)
    assert not hostmem.pin_in_place(platform, t.untyped_storage())
    assert platform.live == set() and len(calls) == 2


@pytest.mark.parametrize("mode", ["module", "layer"])
def test_no_single_pin_exceeds_the_chunk(mode, fake_device, monkeypatch):
    """With ``PIN_CHUNK`` at 16 KiB, ``enable`` (arenas larger than the chunk, tensors
    larger than the chunk) registers nothing larger and allocates no pinned copy larger
    (``pin_memory``); every host copy is still pinned and the output equals all
    resident."""
    chunk = 16 << 10
    monkeypatch.setattr(hostmem, "PIN_CHUNK", chunk)
    make, call, _ = _setup(mode)
    with torch.no_grad():
        want = call(make().to(fake_device), fake_device)
    registered: list[int] = []
    copied: list[int] = []
    fake = type(torch.fakegpu)
    real_register = fake.host_register
    monkeypatch.setattr(fake, "host_register",
                        staticmethod(lambda ptr, n: registered.append(n) or real_register(ptr, n)))
    real_pin = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self, *a: copied.append(self.numel() * self.element_size()) or real_pin(self, *a))
    pipe = make()
    cls = ModelLevelOffloadBackend if mode == "module" else LayerwiseOffloadBackend
    backend = cls({"mode": mode, "components": ["dit"]}, fake_device)
    backend.enable(pipe)
    try:
        s = backend.stats
        assert s.pinned_bytes > 4 * chunk and s.pageable_host_bytes == 0
        assert registered and max(registered) <= chunk
        assert sum(registered) >= s.pinned_bytes - sum(copied)
        assert all(n <= chunk for n in copied)
        with torch.no_grad():
            assert torch.equal(call(pipe, fake_device), want)
        assert backend.audit() == []
    finally:
        backend.disable()


def test_the_staging_ring_buffers_stay_within_the_chunk(monkeypatch):
    monkeypatch.setattr(hostmem, "PIN_CHUNK", 8 << 10)
    sizes = [(100_000, True)] * 10
    plan = tiers.split_tiers(sizes, 400_000)
    assert plan.disk_bytes > 0
    assert plan.staging_bytes == staging.STAGING_COUNT * (8 << 10)
