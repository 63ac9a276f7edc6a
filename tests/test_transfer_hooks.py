"""Unit tests of transfers, hooks and the backend lifecycle on small hand-made pipelines."""

from __future__ import annotations

import functools
from typing import ClassVar

import pytest
import torch
from torch import nn

from diffusion_offload import (
    ModelLevelOffloadBackend,
    SupportsComponentDiscovery,
    offload_component,
)
from diffusion_offload.core import hooks as hooks_mod
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import TEST_DEVICE_TYPE as DEV
from diffusion_offload.testing.pytest_plugin import requires_fake

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}


class BufferOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(12, dtype=torch.float32))
        self.register_buffer("scratch", torch.ones(5), persistent=False)

    def forward(self, x):
        return x * self.table[: x.shape[-1]].sum() + self.scratch.sum()


class Empty(nn.Module):
    def forward(self, x):
        return x + 1


class Lin(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return self.lin(x)


class Pipe(nn.Module, SupportsComponentDiscovery):
    """DiT ``dit`` (Linear), DiT ``dit2`` (buffers only), text encoder, parameterless VAE."""

    _dit_modules: ClassVar[list[str]] = ["dit", "dit2"]
    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]
    _vae_modules: ClassVar[list[str]] = ["vae"]
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.dit = Lin()
        self.dit2 = BufferOnly()
        self.text_encoder = Lin()
        self.vae = Empty()


def _enable(pipe, device, config=FULL):
    backend = ModelLevelOffloadBackend(config, device)
    backend.enable(pipe)
    return backend


def _state(module):
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def test_buffer_only_and_non_persistent_buffers_move(fake_device):
    pipe = Pipe()
    _enable(pipe, fake_device)
    assert pipe.dit2.table.device.type == "cpu" and pipe.dit2.scratch.device.type == "cpu"
    x = torch.ones(2, 3, device=fake_device)
    out = pipe.dit2(x)
    assert pipe.dit2.table.device == fake_device and pipe.dit2.scratch.device == fake_device
    assert out.cpu().tolist() == [[8.0] * 3] * 2  # x * (0+1+2) + 5 * 1.0
    pipe.text_encoder(x.new_ones(2, 8))
    assert pipe.dit2.table.device.type == "cpu" and pipe.dit2.scratch.device.type == "cpu"


@requires_fake
def test_parameterless_module_triggers_nothing(fake_device):
    pipe = Pipe()
    backend = _enable(pipe, fake_device)
    fa.reset_stats()
    before = backend.stats.snapshot()
    out = pipe.vae(torch.zeros(3, device=fake_device))
    with offload_component(pipe.vae):
        pass
    s = fa.stats()
    assert s["transfers"] == 0 and s["synchronizes"] == 0
    assert backend.stats.since(before).loads == 0
    assert out.cpu().tolist() == [1.0, 1.0, 1.0]


@requires_fake
def test_parameterless_selected_dit_triggers_nothing(fake_device):
    class P(Pipe):
        def __init__(self):
            super().__init__()
            self.dit = Empty()

    pipe = P()
    _enable(pipe, fake_device, {"mode": "module", "components": ["text_encoder"]})
    pipe.dit(torch.zeros(1, device=fake_device))  # evicts the text encoder (moves its tensors)
    fa.reset_stats()
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, fake_device)
    pipe2 = P()
    backend.enable(pipe2)
    fa.reset_stats()
    pipe2.dit(torch.zeros(1, device=fake_device))
    pipe2.dit(torch.zeros(1, device=fake_device))
    s = fa.stats()
    assert s["transfers"] == 0 and s["synchronizes"] == 0


@requires_fake
def test_resident_call_is_free(fake_device):
    pipe = Pipe()
    _enable(pipe, fake_device)
    x = torch.ones(2, 8, device=fake_device)
    pipe.dit(x)  # load
    fa.reset_stats()
    pipe.dit(x)
    pipe.dit.forward(x)
    s = fa.stats()
    assert s["transfers"] == 0 and s["synchronizes"] == 0


def test_hook_fires_for_forward_call_and_moves_inputs(fake_device):
    pipe = Pipe()
    _enable(pipe, fake_device)
    out = pipe.dit.forward(torch.ones(2, 8))  # host input, direct .forward
    assert out.device == fake_device
    assert pipe.dit.lin.weight.device == fake_device
    assert pipe.text_encoder.lin.weight.device.type == "cpu"


def test_tied_weights_across_components_move_once_and_stay_tied(fake_device):
    pipe = Pipe()
    pipe.text_encoder.lin.weight = pipe.dit.lin.weight  # tie across two selected components
    w = pipe.dit.lin.weight
    backend = _enable(pipe, fake_device)
    x = torch.ones(1, 8)
    for module in (pipe.dit, pipe.text_encoder, pipe.dit):
        module(x)
        assert pipe.dit.lin.weight is w and pipe.text_encoder.lin.weight is w
        assert w.device == fake_device
    assert isinstance(w, nn.Parameter)
    # one slot for the tied tensor
    slots = {id(s) for c in backend.components.values() for s in c.slots}
    assert len(slots) == len({id(t) for t in list(pipe.parameters()) + list(pipe.buffers())})


def test_tensor_shared_with_resident_component_is_never_evicted(fake_device):
    pipe = Pipe()
    shared = nn.Parameter(torch.ones(8))
    pipe.dit.lin.bias = shared
    pipe.vae.register_parameter("bias", shared)  # VAE is resident
    _enable(pipe, fake_device)
    assert shared.device == fake_device
    pipe.text_encoder(torch.ones(1, 8))
    assert shared.device == fake_device and pipe.dit.lin.weight.device.type == "cpu"


def test_parameter_identity_preserved(fake_device):
    pipe = Pipe()
    ids = {n: id(p) for n, p in pipe.named_parameters()}
    _enable(pipe, fake_device)
    for _ in range(3):
        pipe.dit(torch.ones(1, 8))
        pipe.text_encoder(torch.ones(1, 8))
    assert {n: id(p) for n, p in pipe.named_parameters()} == ids
    assert all(isinstance(p, nn.Parameter) for p in pipe.parameters())


def test_enable_twice_is_a_noop(fake_device):
    pipe = Pipe()
    backend = _enable(pipe, fake_device)
    wrapper = pipe.dit.__dict__["forward"]
    backend.enable(pipe)
    assert pipe.dit.__dict__["forward"] is wrapper
    other = ModelLevelOffloadBackend(FULL, fake_device)
    with pytest.raises(RuntimeError, match="already has an offload hook"):
        other.enable(pipe)
    assert pipe.dit.__dict__["forward"] is wrapper  # the failed enable rolled back
    assert not other.is_enabled()


@pytest.mark.parametrize("fail_at", [1, 2, 3, 4])
def test_rollback_when_nth_hook_install_fails(fake_device, monkeypatch, fail_at):
    pipe = Pipe()
    pipe.to(fake_device)  # start all on the device, so rollback must bring DiTs back
    placement = {n: t.device for n, t in list(pipe.named_parameters()) + list(pipe.named_buffers())}
    values = _state(pipe)
    real = hooks_mod.attach_hook
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("injected install failure")
        return real(*args, **kwargs)

    monkeypatch.setattr("diffusion_offload.core.backends.module.attach_hook", flaky)
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    with pytest.raises(RuntimeError, match="injected"):
        backend.enable(pipe)
    assert not backend.is_enabled()
    for m in pipe.modules():
        assert "forward" not in m.__dict__
        assert hooks_mod.get_hook(m) is None
    now = {n: t.device for n, t in list(pipe.named_parameters()) + list(pipe.named_buffers())}
    assert now == placement
    after = _state(pipe)
    assert all(torch.equal(after[k], values[k]) for k in values)


def test_disable_fails_once_then_succeeds(fake_device, monkeypatch):
    pipe = Pipe()
    backend = _enable(pipe, fake_device)
    real = hooks_mod.HookHandle.remove
    state = {"failed": False}

    def flaky(self):
        if not state["failed"]:
            state["failed"] = True
            raise RuntimeError("injected removal failure")
        return real(self)

    monkeypatch.setattr(hooks_mod.HookHandle, "remove", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        backend.disable()
    assert backend.is_enabled()
    placement = {n: p.device for n, p in pipe.named_parameters()}
    backend.disable()
    assert not backend.is_enabled()
    for m in pipe.modules():
        assert "forward" not in m.__dict__
    assert {n: p.device for n, p in pipe.named_parameters()} == placement  # nothing moved


def _foreign_wrap(module, log):
    inner = module.forward

    @functools.wraps(inner)
    def foreign(*args, **kwargs):
        log.append("foreign")
        return inner(*args, **kwargs)

    module.forward = foreign
    return foreign


@pytest.mark.parametrize("order", ["ours_first", "theirs_first"])
def test_foreign_wrapper_composes(fake_device, order):
    pipe = Pipe()
    log: list[str] = []
    x = torch.ones(1, 8)
    ref = pipe.dit.lin(x).detach()
    if order == "theirs_first":
        foreign = _foreign_wrap(pipe.dit, log)
        backend = _enable(pipe, fake_device)
    else:
        backend = _enable(pipe, fake_device)
        foreign = _foreign_wrap(pipe.dit, log)
    hook_handles = [torch.nn.Module.register_forward_hook(pipe.dit, lambda m, a, o: log.append("torch"))]
    out = pipe.dit(x)
    assert torch.equal(out.cpu(), ref) and log == ["foreign", "torch"] if order == "ours_first" else log == ["foreign", "torch"]
    assert pipe.dit.lin.weight.device == fake_device
    backend.disable()
    pipe.text_encoder(x)  # no offload any more: nothing moves
    assert pipe.dit.lin.weight.device == fake_device
    if order == "theirs_first":
        assert pipe.dit.__dict__["forward"] is foreign  # ours removed, theirs restored
    else:
        assert pipe.dit.__dict__["forward"] is foreign  # theirs kept, ours inert inside
    log.clear()
    out = pipe.dit(x.to(fake_device))
    assert log == ["foreign", "torch"] and torch.equal(out.cpu(), ref)
    for h in hook_handles:
        h.remove()


def test_compile_does_not_recompile_across_eviction(fake_device):
    import torch._dynamo

    torch._dynamo.reset()
    pipe = Pipe()
    x = torch.ones(2, 8)
    ref = pipe.dit(x).detach()
    _enable(pipe, fake_device)
    compiled = torch.compile(pipe.dit, backend="eager")
    # dynamo's own patch (monkeypatch's undo would delete the config entry)
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        first = compiled(x.to(fake_device))
        pipe.text_encoder(x)  # evicts the DiT
        assert pipe.dit.lin.weight.device.type == "cpu"
        second = compiled(x.to(fake_device))
    assert torch.equal(first.cpu(), ref) and torch.equal(second.cpu(), ref)
    torch._dynamo.reset()


def test_inplace_update_survives_eviction(fake_device):
    pipe = Pipe()
    backend = _enable(pipe, fake_device)
    pipe.dit(torch.ones(1, 8))
    with torch.no_grad():
        pipe.dit.lin.weight.mul_(2.0)
    expected = pipe.dit.lin.weight.detach().cpu()
    before = backend.stats.snapshot()
    pipe.text_encoder(torch.ones(1, 8))  # evicts the DiT
    w = pipe.dit.lin.weight
    assert w.device.type == "cpu" and torch.equal(w.detach(), expected)
    assert backend.stats.since(before).d2h_bytes == w.numel() * 4
    pipe.dit(torch.ones(1, 8))
    assert torch.equal(pipe.dit.lin.weight.detach().cpu(), expected)


def test_data_reassignment_survives_eviction(fake_device):
    pipe = Pipe()
    backend = _enable(pipe, fake_device)
    pipe.dit(torch.ones(1, 8))
    replacement = torch.full((8,), 3.0, device=fake_device)
    with torch.no_grad():
        pipe.dit.lin.bias.data = replacement
    before = backend.stats.snapshot()
    pipe.text_encoder(torch.ones(1, 8))
    assert pipe.dit.lin.bias.device.type == "cpu"
    assert pipe.dit.lin.bias.detach().tolist() == [3.0] * 8
    assert backend.stats.since(before).d2h_bytes == 32


@pytest.mark.parametrize("pin", [True, False])
def test_host_copies_pinned_iff_pin_memory(fake_device, pin):
    pipe = Pipe()
    _enable(pipe, fake_device, {"mode": "module", "components": ["dit", "text_encoder"], "pin_memory": pin})
    for t in list(pipe.dit.parameters()) + list(pipe.dit2.buffers()):
        assert t.device.type == "cpu" and t.is_pinned() is pin
    pipe.dit(torch.ones(1, 8))  # text encoder evicted to its host copy
    for t in pipe.text_encoder.parameters():
        assert t.device.type == "cpu" and t.is_pinned() is pin


def test_moves_work_inside_inference_mode(fake_device):
    pipe = Pipe()
    _enable(pipe, fake_device)
    with torch.inference_mode():
        for _ in range(2):
            pipe.dit(torch.ones(1, 8))
            pipe.text_encoder(torch.ones(1, 8))
    assert not pipe.dit.lin.weight.is_inference()


def test_thousand_cycles_bit_identical(fake_device):
    pipe = Pipe()
    values = _state(pipe)
    backend = _enable(pipe, fake_device)
    dit, enc = backend.components["dit"], backend.components["text_encoder"]
    for _ in range(1000):
        enc.evict()
        dit.load()
        dit.evict()
        enc.load()
    assert backend.stats.d2h_bytes == 0
    after = _state(pipe)
    assert all(torch.equal(after[k], values[k]) for k in values)
    assert all(after[k].dtype == values[k].dtype for k in values)


def test_offload_component_context(fake_device):
    pipe = Pipe()
    _enable(pipe, fake_device)
    with offload_component(pipe.dit):
        assert pipe.dit.lin.weight.device == fake_device
        assert pipe.text_encoder.lin.weight.device.type == "cpu"
    assert pipe.dit.lin.weight.device.type == "cpu"
    with pytest.raises(ValueError):
        with offload_component(pipe.text_encoder):
            raise ValueError("body fails")
    assert pipe.text_encoder.lin.weight.device.type == "cpu"
    with offload_component(pipe.vae):  # resident: nothing evicted on exit
        pass
    with pytest.raises(RuntimeError, match="no offload hook"):
        with offload_component(nn.Linear(2, 2)):
            pass


def test_dtensor_moves_shard_locally_and_is_not_pinned(fake_device):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from diffusion_offload.core.platform import platform_for
    from diffusion_offload.core.transfer import Mover, Transaction

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.arange(16, dtype=torch.float32).reshape(4, 4)
        p = nn.Parameter(DTensor.from_local(local.clone(), mesh, [Shard(0)]))
        mover = Mover(platform_for(fake_device), pin_memory=True)
        [slot] = mover.group([p], Transaction(), evictable=True)
        assert slot.nbytes == 64
        assert not p._local_tensor.is_pinned() and not slot.pinned
        assert mover.load(slot, Transaction()) == 64
        assert isinstance(p, DTensor) and p._local_tensor.device == fake_device
        from diffusion_offload.core.checks import compare_with_host

        changed = compare_with_host(mover.stats, [(slot, m) for m in slot.members])
        assert changed == [False]
        assert mover.evict([slot], Transaction(), changed) == 0  # unmodified: no write-back
        assert p._local_tensor.device.type == "cpu" and torch.equal(p._local_tensor, local)
    finally:
        dist.destroy_process_group()


def test_nested_offload_component_evicts_at_outermost_exit(fake_device):
    pipe = Pipe()
    _enable(pipe, fake_device)
    with offload_component(pipe.text_encoder):
        with offload_component(pipe.text_encoder):
            pass
        assert pipe.text_encoder.lin.weight.device == fake_device
    assert pipe.text_encoder.lin.weight.device.type == "cpu"


@requires_fake
def test_failed_partial_load_leaves_nothing_on_device(fake_device):
    pipe = Pipe()
    backend = _enable(pipe, fake_device, {"mode": "module", "components": ["dit", "text_encoder"]})
    pipe.text_encoder(torch.ones(1, 8))  # encoder resident, DiTs on the host
    gc_base = fa.stats()["allocated_bytes"]
    dit = backend.components["dit"]
    first = dit.slots[0].nbytes
    fa.set_capacity(gc_base - backend.components["text_encoder"].nbytes + first)  # room for 1 tensor
    try:
        with pytest.raises(torch.OutOfMemoryError, match="'dit'"):
            pipe.dit(torch.ones(1, 8))
    finally:
        fa.set_capacity(None)
    assert _on_type(pipe.dit, "cpu") and _on_type(pipe.text_encoder, "cpu")
    assert not dit.resident
    out = pipe.dit(torch.ones(1, 8))  # recovers
    assert out.device == fake_device and _on_type(pipe.dit, DEV)


def test_host_data_reassignment_while_evicted_is_loaded(fake_device):
    pipe = Pipe()
    _enable(pipe, fake_device)
    assert pipe.dit.lin.bias.device.type == "cpu"
    with torch.no_grad():
        pipe.dit.lin.bias.data = torch.full((8,), 7.0)
    pipe.dit(torch.ones(1, 8))
    assert pipe.dit.lin.bias.device == fake_device
    assert pipe.dit.lin.bias.cpu().tolist() == [7.0] * 8


@requires_fake
def test_fake_views_inside_inference_mode(fake_device):
    x = torch.arange(10.0).view(1, 10).to(fake_device)
    with torch.inference_mode():
        assert x[:, :3].cpu().tolist() == [[0.0, 1.0, 2.0]]


def _on_type(module, device_type):
    return all(t.device.type == device_type for t in list(module.parameters()) + list(module.buffers()))
