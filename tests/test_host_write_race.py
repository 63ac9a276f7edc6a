"""Host writes into pinned host copies never race a queued H2D copy (issue 38 item 2).

A member replaced on the host while evicted (``p.data = t``) is copied into its pinned
host copy at its next load (``Mover._take_host_writes``). With ``check_writes=False`` no
release waits on the host, so the H2D copy that last read that pinned copy may still be
queued: the mover synchronizes the device before writing (``stats.host_write_waits``).
The fake device's host-race detector raises ``RaceError`` on such a write otherwise; the
last test shows it does, with the wait taken out.
"""

from __future__ import annotations

import pytest
import torch

from diffusion_offload import LayerwiseOffloadBackend
from diffusion_offload.core import transfer
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import requires_fake

from test_offload_property import LAYER, Pipeline

pytestmark = requires_fake


def _replace_in_hook(pipe: Pipeline, value: float, fired: list[torch.device]) -> object:
    """During the next call of ``transformer.blocks.1``, replace the (evicted) bias of
    ``transformer.blocks.0`` by a new host tensor, once: block 0 runs again in the next
    step and loads it."""

    def hook(module: torch.nn.Module, args: tuple) -> None:
        if fired:
            return
        b = pipe.transformer.blocks[0].fc.bias
        fired.append(b.device)
        b.data = torch.full(b.shape, value, dtype=b.dtype, device=b.device)

    return pipe.transformer.blocks[1].register_forward_pre_hook(hook)


def _run(pipe: Pipeline, fake_device: torch.device) -> tuple[list[torch.device], torch.Tensor]:
    """One call to learn the order, then one of two steps with the hook's replacement."""
    pipe(fake_device, steps=1)
    fired: list[torch.device] = []
    handle = _replace_in_hook(pipe, 0.75, fired)
    try:
        out = pipe(fake_device, steps=2)
    finally:
        handle.remove()
    return fired, out


@pytest.mark.parametrize("check_writes", [False, True])
def test_a_host_replacement_between_prefetches_waits_and_is_kept(fake_device, check_writes):
    shadow = Pipeline().to(fake_device)
    shadow(fake_device, steps=1)
    fired: list[torch.device] = []
    handle = _replace_in_hook(shadow, 0.75, fired)
    want = shadow(fake_device, steps=2)
    handle.remove()
    want_next = shadow(fake_device, steps=2)

    fa.synchronize()
    fa.reset_stats()
    pipe = Pipeline()
    backend = LayerwiseOffloadBackend(LAYER, fake_device, check_writes=check_writes)
    backend.enable(pipe)
    try:
        got_fired, got = _run(pipe, fake_device)
        assert got_fired == [torch.device("cpu")]  # evicted when written: a host write
        assert torch.equal(got, want)
        assert torch.equal(pipe(fake_device, steps=2), want_next)
        assert torch.equal(pipe.transformer.blocks[0].fc.bias.cpu(), torch.full((8,), 0.75))
        # one load took the replacement into the pinned host copy, after one synchronize
        assert backend.stats.host_write_waits == 1
        assert fa.stats()["races_detected"] == 0
        assert backend.audit() == []
    finally:
        backend.disable()
    assert torch.equal(pipe.transformer.blocks[0].fc.bias.cpu(), torch.full((8,), 0.75))


def test_a_replacement_on_the_device_is_kept_without_checks(fake_device):
    """``check_writes=False`` skips the device checks; a ``p.data = t`` of a block on the
    device (the carried prefetch, between calls) is still seen on the host and kept."""
    shadow = Pipeline().to(fake_device)
    pipe = Pipeline()
    backend = LayerwiseOffloadBackend(LAYER, fake_device, check_writes=False)
    backend.enable(pipe)
    try:
        assert torch.equal(pipe(fake_device, steps=1), shadow(fake_device, steps=1))
        carried = backend.streamer.prefetched
        assert carried is not None and carried.on_device
        name = f"{carried.component}.{carried.name}.fc"
        for p in (pipe, shadow):
            w = p.get_submodule(name).weight
            assert w.device == fake_device
            w.data = w.detach() * -1.0 + 0.125
        for _ in range(2):
            assert torch.equal(pipe(fake_device, steps=2), shadow(fake_device, steps=2))
        assert backend.stats.device_checks == 0
        assert fa.stats()["races_detected"] == 0
    finally:
        backend.disable()
    assert torch.equal(pipe.get_submodule(name).weight.cpu(), shadow.get_submodule(name).weight.cpu())


def test_without_the_wait_the_detector_sees_the_race(fake_device, monkeypatch):
    """The negative control: with the mover's synchronize taken out, the same replacement
    is a host write while the H2D copy that read the pinned host copy is still queued."""
    real = transfer.Mover._take_host_writes

    def no_wait(self, slot):
        sync = self.platform.synchronize
        self.platform.synchronize = lambda: None
        try:
            real(self, slot)
        finally:
            self.platform.synchronize = sync

    monkeypatch.setattr(transfer.Mover, "_take_host_writes", no_wait)
    fa.synchronize()
    fa.reset_stats()
    pipe = Pipeline()
    backend = LayerwiseOffloadBackend(LAYER, fake_device, check_writes=False)
    backend.enable(pipe)
    try:
        with pytest.raises(fa.RaceError, match="host-to-device copy .* may still be reading it"):
            _run(pipe, fake_device)
    finally:
        monkeypatch.undo()
        fa.synchronize()
        backend.disable()
        fa.reset_stats()
