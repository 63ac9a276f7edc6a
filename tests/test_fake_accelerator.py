"""The fake accelerator: placement errors, exact byte accounting, capacity, pinning."""

from __future__ import annotations

import pytest
import torch

from diffusion_offload.testing import fake_accelerator as fa


def test_install_is_idempotent(fake_device):
    assert fa.install() == fake_device == torch.device("fakegpu", 0)
    assert fa.is_installed()


def test_tensors_carry_real_data(fake_device):
    a = torch.randn(5, 7)
    b = torch.randn(7, 3)
    out = (a.to(fake_device) @ b.to(fake_device)).softmax(-1)
    assert out.device == fake_device
    torch.testing.assert_close(out.cpu(), (a @ b).softmax(-1), rtol=0, atol=0)


def test_mixing_host_tensor_raises_cuda_error(fake_device):
    x = torch.ones(3, device=fake_device)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        x + torch.ones(3)
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.nn.functional.linear(torch.ones(2, 4), torch.ones(3, 4, device=fake_device))
    # a zero-dim host tensor is a scalar, as on CUDA
    assert (x + torch.tensor(2.0)).cpu().tolist() == [3.0, 3.0, 3.0]


def test_byte_counters_are_exact(fake_device):
    fa.reset_stats()
    base = fa.stats()["allocated_bytes"]
    host = torch.zeros(10, 10)  # 400 bytes
    dev = host.to(fake_device)
    s = fa.stats()
    assert s["allocated_bytes"] - base == 400
    assert (s["h2d_bytes"], s["d2h_bytes"], s["transfers"]) == (400, 0, 1)
    view = dev[2:5]  # views add nothing
    assert fa.stats()["allocated_bytes"] - base == 400
    back = view.cpu()
    s = fa.stats()
    assert (s["d2h_bytes"], s["transfers"]) == (back.numel() * 4, 2)
    del dev, view
    assert fa.stats()["allocated_bytes"] == base
    assert fa.stats()["peak_bytes"] >= base + 400


def test_reset_stats_sets_peak_to_allocated(fake_device):
    keep = torch.zeros(8, device=fake_device)
    tmp = torch.zeros(1000, device=fake_device)
    del tmp
    fa.reset_stats()
    s = fa.stats()
    assert s["peak_bytes"] == s["allocated_bytes"]
    assert s["h2d_bytes"] == s["d2h_bytes"] == s["transfers"] == s["synchronizes"] == 0
    del keep


def test_capacity_raises_out_of_memory(fake_device):
    base = fa.stats()["allocated_bytes"]
    fa.set_capacity(base + 1000)
    ok = torch.zeros(250, device=fake_device)  # exactly 1000 bytes
    with pytest.raises(torch.OutOfMemoryError, match="fakegpu out of memory"):
        torch.zeros(1, device=fake_device)
    del ok
    torch.zeros(1, device=fake_device)
    with pytest.raises(ValueError):
        fa.set_capacity(-1)
    with pytest.raises(TypeError):
        fa.set_capacity(1.5)  # type: ignore[arg-type]


def test_pinning_is_simulated(fake_device):
    t = torch.randn(4)
    assert not t.is_pinned()
    p = t.pin_memory()
    assert p.is_pinned() and p.device.type == "cpu"
    assert torch.equal(p, t)
    assert not torch.ones(2, device=fake_device).is_pinned()


def test_synchronize_counts(fake_device):
    before = fa.stats()["synchronizes"]
    torch.fakegpu.synchronize()
    assert fa.stats()["synchronizes"] == before + 1


def test_data_reassignment_rebinds_payload(fake_device):
    with torch.no_grad():
        p = torch.nn.Parameter(torch.zeros(3).to(fake_device))
        p.data = torch.ones(3, device=fake_device)
    assert p.cpu().tolist() == [1.0, 1.0, 1.0]


def test_inplace_bumps_version(fake_device):
    t = torch.zeros(3, device=fake_device)
    v = t._version
    with torch.no_grad():
        t.add_(1)
    assert t._version == v + 1
