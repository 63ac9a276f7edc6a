"""Property test: random sequences of requests, direct calls, writes, LoRA changes,
``.to()`` and interrupts keep the residency invariant, every weight's value, and exact
device->host accounting.

An offloaded toy pipeline and an all-resident shadow (kept outside the backend) get the
same steps. After every step: ``backend.audit() == []``; every weight of the offloaded
pipeline equals the shadow's; ``stats.d2h_bytes`` equals exactly the bytes of the
tensors whose bytes changed while resident, counted once when they leave the device;
and requests give the shadow's output.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from diffusion_offload import ModelLevelOffloadBackend, offload_component
from diffusion_offload.core import transfer as transfer_mod
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import requires_fake
from diffusion_offload.testing.toy import ToyPipeline

pytestmark = requires_fake

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}
SELECTED = ("transformer", "transformer_2", "encoders.text")
WRITES = ("no_grad add_", "data.add_", "data +=", "data.copy_", "data = new", "data = same bytes")


class LoraBranch(nn.Module):
    """A LoRA-like branch around a Linear (what peft's layer replacement does)."""

    def __init__(self, base: nn.Linear, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.base = base
        # created on the host, as a LoRA file's tensors are
        self.down = nn.Linear(base.in_features, 2, bias=False)
        self.up = nn.Linear(2, base.out_features, bias=False)
        with torch.no_grad():
            self.down.weight.copy_(torch.randn(self.down.weight.shape, generator=g))
            self.up.weight.copy_(torch.randn(self.up.weight.shape, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


def _component(pipe: ToyPipeline, name: str) -> nn.Module:
    return pipe.encoders["text"] if name == "encoders.text" else getattr(pipe, name)


def _block(pipe: ToyPipeline, name: str) -> nn.Module:
    comp = _component(pipe, name)
    return comp.block if name == "encoders.text" else comp.blocks[0]


def _write(p: torch.Tensor, path: str) -> bool:
    """Write ``p`` by ``path``; True if its bytes changed."""
    with torch.no_grad():
        if path == "no_grad add_":
            p.add_(1.0)
        elif path == "data.add_":
            p.data.add_(0.5)
        elif path == "data +=":
            p.data += 0.25
        elif path == "data.copy_":
            p.data.copy_(p.detach() * 2.0)
        elif path == "data = new":
            p.data = p.detach() * -1.0 + 0.125
        else:  # layerwise casting: a new tensor holding the same bytes
            p.data = p.detach().clone()
            return False
    return True


class Model:
    """The two pipelines and the expected device->host bytes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pipe = ToyPipeline(dim=8, vocab=8)
        self.shadow = ToyPipeline(dim=8, vocab=8).to(device)
        self.backend = ModelLevelOffloadBackend(FULL, device)
        self.backend.enable(self.pipe)
        self.base_d2h = self.backend.stats.d2h_bytes
        self.expected_d2h = 0
        self.dirty: dict[int, tuple[torch.Tensor, str, int]] = {}  # written while resident
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 8, (1, 3), generator=g)
        self.image = torch.randn(1, 8, generator=g)
        self.loras = 0

    # -- steps -----------------------------------------------------------------------

    def request(self, order: tuple[str, ...]) -> None:
        out = self.pipe(self.ids, self.image, order=order, device=self.device)
        ref = self.shadow(self.ids, self.image, order=order, device=self.device)
        assert torch.equal(out, ref)

    def call(self, which: str) -> None:
        d = self.device
        with torch.no_grad():
            if which == "encoders.text":
                self.pipe.encoders["text"](self.ids.to(d))
            elif which == "child of encoders.text":  # a call below the hooked module
                self.pipe.encoders["text"].block(torch.ones(1, 8, device=d))
            elif which == "offload_component(text)":
                with offload_component(self.pipe.encoders["text"]):
                    pass
            else:
                z = torch.zeros(1, 8, device=d)
                getattr(self.pipe, which)(z, z)

    def write(self, comp: str, path: str) -> None:
        block = _block(self.pipe, comp)
        lin = block.fc1.base if isinstance(block.fc1, LoraBranch) else block.fc1
        p = lin.weight
        resident = p.device == self.device
        changed = _write(p, path)
        sblock = _block(self.shadow, comp)
        slin = sblock.fc1.base if isinstance(sblock.fc1, LoraBranch) else sblock.fc1
        _write(slin.weight, path)
        if changed and resident:
            self.dirty[id(p)] = (p, comp, p.numel() * p.element_size())

    def lora(self, comp: str, action: str) -> None:
        for pipe in (self.pipe, self.shadow):
            block = _block(pipe, comp)
            has = isinstance(block.fc1, LoraBranch)
            if action == "load" and not has:
                block.fc1 = LoraBranch(block.fc1, seed=self.loras)
                if pipe is self.shadow:
                    block.fc1.to(self.device)
            elif action == "unload" and has:
                block.fc1 = block.fc1.base
            elif action == "fuse" and has:
                branch = block.fc1
                w = branch.base.weight
                resident = w.device == self.device
                delta = (branch.up.weight @ branch.down.weight).to(w.device)
                w.data += delta  # peft's merge: an in-place write through .data
                block.fc1 = branch.base
                if pipe is self.pipe and resident:
                    self.dirty[id(w)] = (w, comp, w.numel() * w.element_size())
        self.loras += 1

    def to_device(self) -> None:
        self.pipe.to(self.device)  # keeps the offload placement

    def interrupted_request(self, k: int) -> None:
        before = self.backend.stats.d2h_bytes
        real = transfer_mod._rebind
        state = {"n": 0}

        def flaky(obj, payload):
            real(obj, payload)
            state["n"] += 1
            if state["n"] == k:
                raise KeyboardInterrupt

        transfer_mod._rebind = flaky
        try:
            self.request(("transformer", "transformer_2"))
        except KeyboardInterrupt:
            pass
        finally:
            transfer_mod._rebind = real
        # an eviction rolled back after its write-backs: those tensors are clean now
        extra = self.backend.stats.d2h_bytes - before - self._landed_bytes(peek=True)
        if extra:
            self._clear_written(extra)

    # -- checks ----------------------------------------------------------------------

    def _landed_bytes(self, peek: bool = False) -> int:
        landed = {k: v for k, v in self.dirty.items() if v[0].device.type == "cpu"}
        if not peek:
            for k in landed:
                del self.dirty[k]
        return sum(v[2] for v in landed.values())

    def _clear_written(self, extra: int) -> None:
        by_comp: dict[str, list[int]] = {}
        for key, (_, comp, n) in self.dirty.items():
            by_comp.setdefault(comp, []).append(key)
        for r in range(1, len(by_comp) + 1):
            for combo in itertools.combinations(by_comp, r):
                keys = [k for c in combo for k in by_comp[c] if self.dirty[k][0].device == self.device]
                if sum(self.dirty[k][2] for k in keys) == extra:
                    for k in keys:
                        self.expected_d2h += self.dirty.pop(k)[2]
                    return
        raise AssertionError(f"{extra} D2H bytes match no component's written tensors")

    def check(self) -> None:
        assert self.backend.audit() == []
        self.expected_d2h += self._landed_bytes()
        assert self.backend.stats.d2h_bytes - self.base_d2h == self.expected_d2h
        mine = dict(self.pipe.named_parameters()) | dict(self.pipe.named_buffers())
        theirs = dict(self.shadow.named_parameters()) | dict(self.shadow.named_buffers())
        assert mine.keys() == theirs.keys()
        for name, t in mine.items():
            assert torch.equal(t.detach().cpu(), theirs[name].detach().cpu()), name


ORDERS = st.sampled_from([("transformer", "transformer_2"), ("transformer_2",), ("transformer",)])
STEP = st.one_of(
    st.tuples(st.just("request"), ORDERS),
    st.tuples(
        st.just("call"),
        st.sampled_from(
            ["transformer", "transformer_2", "encoders.text", "child of encoders.text",
             "offload_component(text)"]
        ),
    ),
    st.tuples(st.just("write"), st.sampled_from(SELECTED), st.sampled_from(WRITES)),
    st.tuples(st.just("lora"), st.sampled_from(SELECTED[:2]), st.sampled_from(["load", "unload", "fuse"])),
    st.tuples(st.just("to_device")),
    st.tuples(st.just("interrupted_request"), st.integers(min_value=1, max_value=40)),
)


def _run_steps(steps: list[tuple]) -> None:
    device = fa.install()
    model = Model(device)
    try:
        for step in steps:
            getattr(model, step[0])(*step[1:])
            model.check()
    finally:
        model.backend.disable()


_SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=60, **_SETTINGS)
@given(steps=st.lists(STEP, min_size=1, max_size=4))
def test_random_steps_keep_invariant_values_and_d2h(steps):
    """60 derandomized sequences (the README's test command)."""
    _run_steps(steps)


@pytest.mark.full
@settings(max_examples=300, **_SETTINGS)
@given(steps=st.lists(STEP, min_size=1, max_size=4))
def test_random_steps_keep_invariant_values_and_d2h_full(steps):
    """300 sequences (``.ci/run``: marker ``full``)."""
    _run_steps(steps)
