"""Host arenas and their write check (issue 18 item 2): one H2D copy per arena, device
tensors that are views of one allocation freed together, Parameter identity, ties, mixed
dtypes, alignment and non-contiguous tensors, a weight replaced after ``enable``, the
``max_pinned_bytes`` cut, and the detection properties of the arena sums."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusion_offload import ModelLevelOffloadBackend, SupportsComponentDiscovery
from diffusion_offload.core import arena as arena_mod
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import requires_fake

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}


class Mixed(nn.Module):
    """Tensors of three dtypes, odd sizes (padding), a tie and a non-contiguous one."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(7, 5, generator=g))  # 140 B: padded to 144
        self.b = nn.Parameter(torch.randn(9, generator=g).to(torch.bfloat16))  # 18 B
        self.c = nn.Parameter(torch.randn(6, 4, generator=g).double().t())  # non-contiguous
        self.tied = self.a  # the same Parameter under two names
        self.register_buffer("steps", torch.arange(3))  # int64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.a + self.b.float().sum() + self.c.float().sum() + self.steps.float().sum()
        return y @ self.tied.t()


def _pipe() -> nn.Module:
    class Pipe(nn.Module, SupportsComponentDiscovery):
        _dit_modules = ["transformer"]
        _encoder_modules = ["text_encoder"]
        _vae_modules: list = []
        _resident_modules: list = []

    pipe = Pipe()
    pipe.transformer, pipe.text_encoder = Mixed(), nn.Linear(7, 7)
    return pipe


def _tensors(m: nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for t in [*m.parameters(), *m.buffers()]}.values())


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@requires_fake
def test_a_component_loads_as_one_copy_into_one_allocation_freed_together(fake_device):
    pipe = _pipe()
    x = torch.randn(2, 7)
    with torch.no_grad():  # (an autograd graph would hold the fake device's old payloads)
        want = pipe.transformer(x)
    objs = {id(t) for t in _tensors(pipe.transformer)}
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        comp = backend.components["transformer"]
        arenas = {id(s.arena): s.arena for s in comp.slots}
        assert len(arenas) == 1 and None not in arenas.values()
        [arena] = arenas.values()
        # every host copy at a 16-byte aligned offset of one pinned buffer (a 140-byte and
        # an 18-byte tensor are padded: 26 bytes here, under 1 % of a real model)
        assert all(off % arena_mod.ALIGN == 0 for off in arena.offsets.values())
        tensors = _tensors(pipe.transformer)
        assert _nbytes(tensors) == 374 and arena.nbytes == 400
        assert all(t.is_pinned() for t in tensors) and arena.host.is_pinned()
        fa.reset_stats()
        before = backend.stats.snapshot()
        with torch.no_grad():
            got = pipe.transformer(x.to(fake_device)).cpu()
        s = fa.stats()
        done = backend.stats.since(before)
        assert torch.equal(got, want)
        # one H2D copy of the arena's bytes; the other copies: the input, the output, the
        # arena's sums copied back after the load (no wait), the text encoder's eviction
        # check (its arena's sums read back), and the two checks' weights (8 bytes per byte
        # of each arena's grid width: ``checks.device_weights``)
        widths = [arena.shape[1], backend.components["text_encoder"].slots[0].arena.shape[1]]
        assert widths == [16, 0]  # the text encoder's arena is small: read back as it is
        assert done.check_h2d_bytes == 8 * sum(widths)
        assert s["h2d_bytes"] == arena.nbytes + x.numel() * 4 + 8 * sum(widths) and s["transfers"] == 6
        keys = {fa.storage_key(t) for t in _tensors(pipe.transformer)}
        assert len(keys) == 1 and all(t.device == fake_device for t in _tensors(pipe.transformer))
        assert {id(t) for t in _tensors(pipe.transformer)} == objs  # the same Parameters
        assert pipe.transformer.tied is pipe.transformer.a
        live = fa.live_storages()
        [key] = keys
        assert live[key] == arena.nbytes  # the arena alone: the write check keeps nothing there
        with torch.no_grad():
            pipe.text_encoder(torch.ones(1, 7))  # evicts the DiT: no weight byte back
        assert pipe.transformer.a.device.type == "cpu"
        fa.synchronize()
        assert key not in fa.live_storages()  # freed together
        assert backend.stats.d2h_bytes == 0 and backend.audit() == []


@requires_fake
def test_one_device_comparison_per_eviction_and_each_write_path_written_back(fake_device):
    pipe = _pipe()
    x = torch.randn(2, 7)
    with ModelLevelOffloadBackend(FULL, fake_device) as backend:
        backend.enable(pipe)
        for write, expect in (
            (None, 0),
            (lambda m: m.a.data.add_(1.0), 140),  # .data in-place: invisible to _version
            (lambda m: m.b.add_(1.0), 18),
            (lambda m: setattr(m.c, "data", m.c.detach() * 2.0), 192),  # .data reassigned
            (lambda m: setattr(m.a, "data", m.a.detach().clone()), 0),  # equal bytes
        ):
            with torch.no_grad():
                pipe.transformer(x.to(fake_device))
                before = backend.stats.snapshot()
                fa.reset_stats()
                if write is not None:
                    write(pipe.transformer)
                want = {n: t.detach().cpu().clone() for n, t in pipe.transformer.named_parameters()}
                pipe.text_encoder(torch.ones(1, 7))  # evicts the DiT
            done = backend.stats.since(before)
            assert done.d2h_bytes == expect and done.device_checks == 1
            for n, t in pipe.transformer.named_parameters():
                assert t.device.type == "cpu" and torch.equal(t.detach(), want[n])
            if write is None:  # the checks' sums only: the DiT's read back at its eviction,
                # the text encoder's copied back (no wait) after its load
                dit, te = (
                    next(iter({id(x.arena): x.arena for x in backend.components[n].slots}.values()))
                    for n in ("transformer", "text_encoder")
                )
                assert done.check_d2h_bytes == 4 * (dit.sum_words + te.sum_words)
        assert backend.audit() == []


@requires_fake
def test_a_weight_replaced_after_enable_works_and_joins_an_arena_at_the_next_enable(fake_device):
    pipe = _pipe()
    x = torch.randn(2, 7)
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    with torch.no_grad():
        pipe.transformer.extra = nn.Parameter(torch.ones(3))  # adopted at the next load
        pipe.transformer(x.to(fake_device))
        pipe.text_encoder(torch.ones(1, 7))
    slot = backend.components["transformer"].table.slot_of(pipe.transformer.extra)
    assert slot is not None and slot.arena is None and pipe.transformer.extra.device.type == "cpu"
    backend.disable()
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    slot = backend.components["transformer"].table.slot_of(pipe.transformer.extra)
    assert slot.arena is not None
    assert len({id(s.arena) for s in backend.components["transformer"].slots}) == 1
    backend.disable()


@requires_fake
def test_max_pinned_bytes_cuts_an_arena_at_the_cap(fake_device):
    pipe = _pipe()
    with ModelLevelOffloadBackend(FULL, fake_device, max_pinned_bytes=150) as backend:
        backend.enable(pipe)
        arenas = {id(s.arena): s.arena for c in backend.components.values() for s in c.slots}
        pinned = [a for a in arenas.values() if a.pinned]
        s = backend.stats
        # the cap holds the pinned arenas, padding included; the load's check buffers are
        # counted apart from the host copies (pinned_overhead_bytes)
        assert sum(a.nbytes for a in pinned) <= 150 and pinned
        assert sum(sum(s.nbytes for s in a.slots) for a in pinned) == s.pinned_bytes


