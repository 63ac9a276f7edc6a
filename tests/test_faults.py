"""Fault injection: a KeyboardInterrupt after the k-th tensor move of every transition.

For each kind of transition (component load, component eviction, ``enable`` from the
host and from the device, ``disable``, a ``PartSwitcher`` switch) the interrupt is
raised after every k in turn. Afterwards ``backend.audit() == []``, the device holds
exactly the resident set (no partial group, nothing waiting for ``gc``), and the next
request equals the all-resident output.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from diffusion_offload import ModelLevelOffloadBackend, PartSwitcher
from diffusion_offload.core import transfer as transfer_mod
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import requires_fake
from diffusion_offload.testing.toy import ToyPipeline

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}

pytestmark = requires_fake


class Interrupt:
    """Replace the move primitive: after the k-th move, raise KeyboardInterrupt (once)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, k: int | None) -> None:
        self.k, self.moves, self.fired = k, 0, False
        self._real = transfer_mod._rebind
        monkeypatch.setattr(transfer_mod, "_rebind", self)

    def __call__(self, obj: torch.Tensor, payload: torch.Tensor) -> None:
        self._real(obj, payload)
        if self.fired:
            return
        self.moves += 1
        if self.moves == self.k:
            self.fired = True
            raise KeyboardInterrupt(f"injected after move {self.k}")


def _inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 32, (2, 5), generator=g), torch.randn(2, 16, generator=g)


def _reference(device) -> torch.Tensor:
    ids, image = _inputs()
    return ToyPipeline().to(device)(ids, image, device=device)


def _device_storages(pipe: nn.Module, device) -> set[int]:
    """The device storages the pipeline's tensors use now."""
    return {
        fa.storage_key(t)
        for t in list(pipe.parameters()) + list(pipe.buffers())
        if t.device == device
    }


def _check_consistent(pipe, backend, device, base: set[int], ref: torch.Tensor) -> None:
    """``base``: the live device storages before the pipeline was built."""
    assert backend.audit() == []
    # exactly the resident set is allocated: no partial group, no device copy kept alive
    live = set(fa.live_storages())
    resident = _device_storages(pipe, device)
    assert live - base <= resident  # nothing allocated since ``base`` outlives the transition
    assert resident <= live
    ids, image = _inputs()
    assert torch.equal(pipe(ids, image, device=device), ref)
    assert backend.audit() == []


def _count_moves(monkeypatch, action) -> int:
    counter = Interrupt(monkeypatch, None)
    action()
    monkeypatch.setattr(transfer_mod, "_rebind", counter._real)
    return counter.moves


def _prepared(device, stage: str):
    """A fresh offloaded toy pipeline with the encoders resident (stage 'encoders') or
    the DiT ``transformer`` resident (stage 'dit')."""
    pipe = ToyPipeline()
    backend = ModelLevelOffloadBackend(FULL, device)
    backend.enable(pipe)
    ids, image = _inputs()
    with torch.no_grad():
        if stage == "dit":
            pipe.transformer(torch.zeros(2, 16, device=device), torch.zeros(2, 16, device=device))
        else:
            pipe.encoders["text"](ids.to(device))
    return pipe, backend


def _dit_call(pipe, device):
    with torch.no_grad():
        pipe.transformer(torch.zeros(2, 16, device=device), torch.zeros(2, 16, device=device))


def _encoder_call(pipe, device):
    ids, _ = _inputs()
    with torch.no_grad():
        pipe.encoders["text"](ids.to(device))


#: the README's test command interrupts at every third move (and the last one); the
#: ``full`` run at every move
SWEEPS = ["sample", pytest.param("full", marks=pytest.mark.full)]


def _ks(n: int, sweep: str) -> list[int]:
    """The moves to interrupt after, of ``n``: all of them (``full``), or every third
    and the last (``sample``)."""
    return list(range(1, n + 1)) if sweep == "full" else sorted({*range(1, n + 1, 3), n})


@pytest.mark.parametrize("sweep", SWEEPS)
@pytest.mark.parametrize(
    "stage, call, what",
    [("encoders", _dit_call, "load of a DiT (after evicting the encoders)"),
     ("dit", _encoder_call, "eviction of a DiT (then the encoders load)")],
)
def test_interrupt_in_activation_after_every_move(fake_device, monkeypatch, stage, call, what, sweep):
    ref = _reference(fake_device)
    probe, _ = _prepared(fake_device, stage)
    n = _count_moves(monkeypatch, lambda: call(probe, fake_device))
    assert n >= 4, what
    for k in _ks(n, sweep):
        gc.collect()  # the previous iteration's pipeline (hooks form collectable cycles)
        base = set(fa.live_storages())
        pipe, backend = _prepared(fake_device, stage)
        inject = Interrupt(monkeypatch, k)
        try:
            call(pipe, fake_device)
        except KeyboardInterrupt:
            pass
        assert inject.fired, (what, k)
        monkeypatch.setattr(transfer_mod, "_rebind", inject._real)
        _check_consistent(pipe, backend, fake_device, base, ref)
        backend.disable()
        del pipe, backend


@pytest.mark.parametrize("sweep", SWEEPS)
@pytest.mark.parametrize("start", ["host", "device"])
def test_interrupt_in_enable_after_every_move(fake_device, monkeypatch, start, sweep):
    ref = _reference(fake_device)

    def fresh():
        pipe = ToyPipeline()
        if start == "device":
            pipe.to(fake_device)
        return pipe

    probe = fresh()
    n = _count_moves(monkeypatch, lambda: ModelLevelOffloadBackend(FULL, fake_device).enable(probe))
    assert n >= 4
    for k in _ks(n, sweep):
        gc.collect()
        base = set(fa.live_storages())
        pipe = fresh()
        placement = {name: t.device for name, t in pipe.state_dict(keep_vars=True).items()}
        values = {name: t.detach().cpu().clone() for name, t in pipe.state_dict().items()}
        before = fa.stats()["allocated_bytes"]
        backend = ModelLevelOffloadBackend(FULL, fake_device)
        inject = Interrupt(monkeypatch, k)
        with pytest.raises(KeyboardInterrupt):
            backend.enable(pipe)
        assert inject.fired
        monkeypatch.setattr(transfer_mod, "_rebind", inject._real)
        assert not backend.is_enabled()
        assert {n_: t.device for n_, t in pipe.state_dict(keep_vars=True).items()} == placement
        assert all(torch.equal(t.detach().cpu(), values[n_]) for n_, t in pipe.state_dict().items())
        # nothing allocated is left (a DiT evicted from the device is loaded again)
        assert fa.stats()["allocated_bytes"] <= before
        for m in pipe.modules():
            assert "forward" not in m.__dict__ and "_apply" not in m.__dict__
        backend.enable(pipe)  # a retry enables normally
        _check_consistent(pipe, backend, fake_device, base, ref)
        backend.disable()
        del pipe, backend


def test_interrupt_in_disable_after_every_hook_removal(fake_device, monkeypatch):
    from diffusion_offload.core import hooks as hooks_mod

    ref = _reference(fake_device)
    real = hooks_mod.HookHandle.remove
    for k in range(1, 6):  # five components: two DiTs, two encoders, the VAE
        gc.collect()
        base = set(fa.live_storages())
        pipe, backend = _prepared(fake_device, "encoders")
        calls = {"n": 0}

        def flaky(self, k=k):
            calls["n"] += 1
            if calls["n"] == k:
                raise KeyboardInterrupt("injected in disable")
            return real(self)

        monkeypatch.setattr(hooks_mod.HookHandle, "remove", flaky)
        with pytest.raises(KeyboardInterrupt):
            backend.disable()
        assert backend.is_enabled() and backend.audit() == []
        monkeypatch.setattr(hooks_mod.HookHandle, "remove", real)
        _check_consistent(pipe, backend, fake_device, base, ref)
        backend.disable()  # the retry finishes the job
        assert not backend.is_enabled()
        assert all("forward" not in m.__dict__ for m in pipe.modules())


def test_interrupt_in_part_switch_after_every_move(fake_device, monkeypatch):
    torch.manual_seed(0)
    a, b = nn.Linear(32, 32), nn.Linear(32, 32)
    x = torch.randn(4, 32)
    ref_a, ref_b = a(x).detach(), b(x).detach()

    def fresh():
        parts = {"a": nn.Linear(32, 32), "b": nn.Linear(32, 32)}
        parts["a"].load_state_dict(a.state_dict())
        parts["b"].load_state_dict(b.state_dict())
        sw = PartSwitcher(parts, fake_device)
        with sw.part("a"):
            pass
        return parts, sw

    parts, sw = fresh()

    def switch():
        with sw.part("b"):
            pass

    n = _count_moves(monkeypatch, switch)
    assert n == 4  # evict a (weight, bias), load b (weight, bias)
    for k in range(1, n + 1):
        parts, sw = fresh()
        gc.collect()
        base = set(fa.live_storages())
        inject = Interrupt(monkeypatch, k)
        with pytest.raises(KeyboardInterrupt):
            with sw.part("b"):
                pass
        monkeypatch.setattr(transfer_mod, "_rebind", inject._real)
        sides = {name: {t.device.type for t in m.parameters()} for name, m in parts.items()}
        assert all(len(s) == 1 for s in sides.values()), sides  # never a split part
        assert sw.active in (None, "a") and (sw.active is None or sides["a"] == {"fakegpu"})
        assert set(fa.live_storages()) <= base  # nothing new is left allocated
        with torch.no_grad():
            with sw.part("b"):
                assert torch.equal(parts["b"](x.to(fake_device)).cpu(), ref_b)
            with sw.part("a"):
                assert torch.equal(parts["a"](x.to(fake_device)).cpu(), ref_a)


def test_ctrl_c_during_a_rollback_is_held_until_it_completes(fake_device, monkeypatch):
    import os
    import signal

    ref = _reference(fake_device)
    gc.collect()
    base = set(fa.live_storages())
    pipe, backend = _prepared(fake_device, "encoders")
    inject = Interrupt(monkeypatch, 3)  # first interrupt: mid-load of the DiT
    real = inject._real
    state = {"n": 0}

    def second_ctrl_c(obj, payload):  # a real SIGINT during the rollback's first move
        inject(obj, payload)
        if inject.fired:
            state["n"] += 1
            if state["n"] == 2:
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(transfer_mod, "_rebind", second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        _dit_call(pipe, fake_device)
    monkeypatch.setattr(transfer_mod, "_rebind", real)
    assert state["n"] > 2  # the rollback went on after the signal
    _check_consistent(pipe, backend, fake_device, base, ref)
    backend.disable()
