"""Model-level offload of the toy pipeline on the fake accelerator (issue 2 "Must show")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusion_offload import ModelLevelOffloadBackend
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import TEST_DEVICE_TYPE as DEV
from diffusion_offload.testing.pytest_plugin import requires_fake
from diffusion_offload.testing.toy import ToyPipeline

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}
ORDERS = [
    ("transformer", "transformer_2"),
    ("transformer_2", "transformer"),
    ("transformer", "transformer_2", "transformer", "transformer_2"),
]
NAMES = ["transformer", "transformer_2", "encoders.text", "encoders.image", "vae"]


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 32, (2, 5), generator=g), torch.randn(2, 16, generator=g)


def _module(pipe: ToyPipeline, name: str) -> nn.Module:
    return pipe.get_submodule(name)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return list(module.parameters()) + list(module.buffers())


def _on(module: nn.Module, device_type: str) -> bool:
    return all(t.device.type == device_type for t in _tensors(module))


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(module))


def _resident_reference(device):
    pipe = ToyPipeline()
    pipe.to(device)
    return pipe


def _expected_exclusion(name: str, selected: set[str]) -> set[str]:
    """Exclusion sets written from SPEC section 4, independent of the backend's own state."""
    dits = {"transformer", "transformer_2"}
    if name in dits:
        return (selected - {name})
    if name.startswith("encoders."):
        return selected & dits
    return set()


def _install_probes(pipe: ToyPipeline, selected: set[str], violations: list[str], seen: set[str]):
    """Pre-forward probes on every leaf module: placement checked from inside the model."""
    handles = []
    for name in NAMES:
        comp = _module(pipe, name)
        for leaf in comp.modules():
            if list(leaf.children()):
                continue

            def probe(mod, args, name=name, comp=comp):
                seen.add(name)
                if not _on(comp, DEV):
                    violations.append(f"{name} not wholly on the device during its forward")
                for other in _expected_exclusion(name, selected):
                    if not _on(_module(pipe, other), "cpu"):
                        violations.append(f"{other} not on the host while {name} runs")

            handles.append(leaf.register_forward_pre_hook(probe))
    return handles


@pytest.mark.parametrize("order", ORDERS, ids=["A,B", "B,A", "A,B,A,B"])
def test_outputs_equal_and_placement_probed(fake_device, order):
    ids, image = _inputs()
    ref = _resident_reference(fake_device)(ids, image, order=order, device=fake_device)
    pipe = ToyPipeline()
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    violations: list[str] = []
    seen: set[str] = set()
    _install_probes(pipe, {"transformer", "transformer_2", "encoders.text"}, violations, seen)
    for _ in range(2):
        out = pipe(ids, image, order=order, device=fake_device)
        assert torch.equal(out, ref)
    assert violations == []
    assert seen == set(NAMES)


def test_invariant_after_enable(fake_device):
    pipe = ToyPipeline()
    pipe.to(fake_device)  # the loader put everything on the device
    ModelLevelOffloadBackend(FULL, fake_device).enable(pipe)
    assert _on(pipe.transformer, "cpu") and _on(pipe.transformer_2, "cpu")
    for name in ("encoders.text", "encoders.image", "vae"):
        assert _on(_module(pipe, name), DEV), name


@pytest.mark.parametrize(
    "components, offloaded",
    [
        (["dit"], {"transformer", "transformer_2"}),
        (["text_encoder"], {"encoders.text"}),
        (["dit", "text_encoder"], {"transformer", "transformer_2", "encoders.text"}),
    ],
)
def test_selection_only_moves_selected(fake_device, components, offloaded):
    ids, image = _inputs()
    ref = _resident_reference(fake_device)(ids, image, device=fake_device)
    pipe = ToyPipeline()
    backend = ModelLevelOffloadBackend({"mode": "module", "components": components}, fake_device)
    backend.enable(pipe)
    violations: list[str] = []
    seen: set[str] = set()
    _install_probes(pipe, offloaded, violations, seen)
    host_seen: set[str] = set()

    def record(mod, args):
        for name in NAMES:
            if not _on(_module(pipe, name), DEV):
                host_seen.add(name)

    for leaf in pipe.modules():
        if not list(leaf.children()):
            leaf.register_forward_pre_hook(record)
    assert torch.equal(pipe(ids, image, device=fake_device), ref)
    assert violations == []
    assert host_seen <= offloaded  # nothing unselected ever left the device
    assert host_seen, "selected components were never evicted"


def test_legacy_enable_cpu_offload_offloads_every_encoder(fake_device):
    from diffusion_offload import parse_diffusion_offload_config

    ids, image = _inputs()
    ref = _resident_reference(fake_device)(ids, image, device=fake_device)
    pipe = ToyPipeline()
    config = parse_diffusion_offload_config(None, enable_cpu_offload=True)
    backend = ModelLevelOffloadBackend(config, fake_device)
    backend.enable(pipe)
    selected = {"transformer", "transformer_2", "encoders.text", "encoders.image"}
    assert {n for n, w in backend.components.items() if w.selected} == selected
    violations: list[str] = []
    seen: set[str] = set()
    # legacy: the DiT's exclusion set includes the image encoder too
    handles = _install_probes(pipe, selected, violations, seen)
    assert torch.equal(pipe(ids, image, device=fake_device), ref)
    assert violations == []
    for h in handles:
        h.remove()
    pipe(ids, image, device=fake_device)
    assert _on(pipe.encoders.image, "cpu")  # a DiT ran last: the image encoder was evicted


@requires_fake
def test_capacity_fits_one_dit_not_two(fake_device):
    ids, image = _inputs()
    probe = ToyPipeline()
    dit = _nbytes(probe.transformer)
    assert dit == _nbytes(probe.transformer_2)
    rest = sum(_nbytes(_module(probe, n)) for n in ("encoders.text", "encoders.image", "vae"))
    fa.reset_stats()
    base = fa.stats()["allocated_bytes"]
    # one DiT + everything resident + room for activations, but not two DiTs
    capacity = base + dit + rest + dit // 2
    fa.set_capacity(capacity)
    with pytest.raises(torch.OutOfMemoryError):
        ToyPipeline().to(fake_device)
    pipe = ToyPipeline()
    ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, fake_device).enable(pipe)
    out = pipe(ids, image, device=fake_device)
    fa.set_capacity(None)
    ref = _resident_reference(fake_device)(ids, image, device=fake_device)
    assert torch.equal(out, ref)


@requires_fake
def test_transfer_totals_match_engine_counters(fake_device):
    ids, image = _inputs()
    ref_pipe = _resident_reference(fake_device)
    fa.reset_stats()
    for order in ORDERS:
        ref_pipe(ids, image, order=order, device=fake_device)
    resident = fa.stats()

    pipe = ToyPipeline()
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    fa.reset_stats()
    before = backend.stats.snapshot()
    for order in ORDERS:
        pipe(ids, image, order=order, device=fake_device)
    offload = fa.stats()
    engine = backend.stats.since(before)
    assert engine.d2h_bytes == 0
    # the write checks' read-backs (none when nothing changed: one comparison on the device)
    assert offload["d2h_bytes"] - resident["d2h_bytes"] == engine.d2h_bytes + engine.check_d2h_bytes
    # and the checks' weights (``checks.device_weights``), the one other H2D
    assert offload["h2d_bytes"] - resident["h2d_bytes"] == engine.h2d_bytes + engine.check_h2d_bytes
    assert engine.check_h2d_bytes > 0
    dits = _nbytes(pipe.transformer) + _nbytes(pipe.transformer_2)
    text = _nbytes(pipe.encoders.text)
    # per request: text encoder reloaded (except the first), each DiT call loads one DiT
    calls = sum(len(o) for o in ORDERS)
    assert engine.h2d_bytes == calls * _nbytes(pipe.transformer) + (len(ORDERS) - 1) * text
    assert dits == 2 * _nbytes(pipe.transformer)


def test_bad_selection_rejected_before_any_change(fake_device):
    class NoText(nn.Module):
        from typing import ClassVar

        _dit_modules: ClassVar[list[str]] = ["dit"]
        _encoder_modules: ClassVar[list[str]] = ["image_encoder"]
        _vae_modules: ClassVar[list[str]] = []
        _resident_modules: ClassVar[list[str]] = []

    from diffusion_offload import SupportsComponentDiscovery

    class Pipe(NoText, SupportsComponentDiscovery):
        def __init__(self):
            super().__init__()
            self.dit = nn.Linear(4, 4)
            self.image_encoder = nn.Linear(4, 4)

    pipe = Pipe()
    before = {id(p): p.clone() for p in pipe.parameters()}
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    with pytest.raises(ValueError, match="no text encoder"):
        backend.enable(pipe)
    assert not backend.is_enabled()
    assert "forward" not in pipe.dit.__dict__ and "forward" not in pipe.image_encoder.__dict__
    for p in pipe.parameters():
        assert p.device.type == "cpu" and torch.equal(p, before[id(p)])


def test_cpu_device_is_a_noop():
    pipe = ToyPipeline()
    backend = ModelLevelOffloadBackend(FULL, "cpu")
    backend.enable(pipe)
    assert backend.is_enabled() and backend.components == {}
    assert "forward" not in pipe.transformer.__dict__
    backend.disable()
