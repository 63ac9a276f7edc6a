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


# ----------------------------------------------------------------- device ops, host waits


def _counts(fn) -> tuple[int, int, int]:
    """(device_ops, host_waits, transfers) spent by ``fn()``."""
    fa.reset_stats()
    fn()
    s = fa.stats()
    return s["device_ops"], s["host_waits"], s["transfers"]


def test_device_ops_count_kernels_not_views_or_allocations(fake_device):
    a = torch.randn(4, 4).to(fake_device)
    b = torch.randn(4, 4).to(fake_device)
    assert _counts(lambda: a + b) == (1, 0, 0)
    assert _counts(lambda: (a @ b).relu_()) == (2, 0, 0)
    # views and metadata: no kernel
    assert _counts(lambda: (a.view(16), a.t(), a[1:3], a.detach(), a.expand(2, 4, 4))) == (0, 0, 0)
    assert _counts(lambda: a.clone().t_().unsqueeze_(0)) == (1, 0, 0)  # the clone only
    # allocation without a fill launches nothing on CUDA; a fill or factory kernel is one op
    assert _counts(lambda: torch.empty(8, device=fake_device)) == (0, 0, 0)
    assert _counts(lambda: torch.empty_strided((2, 2), (1, 2), device=fake_device)) == (0, 0, 0)
    assert _counts(lambda: (torch.empty_like(a), a.new_empty(3))) == (0, 0, 0)
    assert _counts(lambda: torch.zeros(8, device=fake_device)) == (1, 0, 0)
    assert _counts(lambda: torch.full((3,), 2.0, device=fake_device)) == (1, 0, 0)
    assert _counts(lambda: torch.arange(5, device=fake_device)) == (1, 0, 0)
    assert _counts(lambda: torch.linspace(0, 1, 5, device=fake_device)) == (1, 0, 0)
    assert _counts(lambda: a.t().contiguous()) == (1, 0, 0)  # one copy kernel
    assert _counts(lambda: a.t().reshape(16)) == (1, 0, 0)  # clone + _unsafe_view
    linear = torch.nn.Linear(4, 3).to(fake_device)
    with torch.no_grad():
        assert _counts(lambda: linear(a)) == (1, 0, 0)  # one addmm


def test_data_assignment_is_no_device_op(fake_device):
    p = torch.nn.Parameter(torch.zeros(3))
    on_device = torch.ones(3, device=fake_device)
    host = torch.zeros(3)

    def rebind(new):
        with torch.no_grad():
            p.data = new

    assert _counts(lambda: rebind(on_device)) == (0, 0, 0)  # host -> device: a rebind
    assert _counts(lambda: rebind(torch.full((3,), 2.0).to(fake_device).data)) == (1, 0, 1)  # the copy
    assert _counts(lambda: rebind(host)) == (0, 0, 0)
    assert _counts(lambda: p.data) == (0, 0, 0)


def test_host_to_device_copy_is_one_device_op_and_no_host_wait(fake_device):
    host = torch.randn(4, 4)
    assert _counts(lambda: host.to(fake_device)) == (1, 0, 1)
    dev = torch.empty(4, 4, device=fake_device)
    assert _counts(lambda: dev.copy_(host)) == (1, 0, 1)
    assert _counts(lambda: dev.copy_(host.pin_memory(), non_blocking=True)) == (1, 0, 1)
    # torch.tensor(data, device=...) copies below Python dispatch (aten::_copy_from)
    assert _counts(lambda: torch.tensor([1.0, 2.0], device=fake_device)) == (1, 0, 1)
    assert _counts(lambda: dev.to(fake_device)) == (0, 0, 0)  # already there: no copy
    assert _counts(lambda: dev.to(torch.float64)) == (1, 0, 0)  # a cast on the device


def test_device_to_host_reads_are_host_waits(fake_device):
    a = torch.randn(4, 4).to(fake_device)
    assert _counts(lambda: a.cpu()) == (1, 1, 1)
    assert _counts(lambda: a[0, 0].item()) == (1, 1, 1)
    assert _counts(lambda: float(a[0, 0])) == (1, 1, 1)
    assert _counts(lambda: a.tolist()) == (1, 1, 1)
    assert _counts(lambda: torch.empty(4, 4).copy_(a)) == (1, 1, 1)
    assert _counts(lambda: bool((a > 0).all())) == (3, 1, 1)  # gt, all, the read
    pinned = torch.empty(4, 4).pin_memory()
    assert _counts(lambda: pinned.copy_(a, non_blocking=True)) == (1, 1, 1)
    fa.synchronize()
    assert _counts(lambda: a.to("cpu", non_blocking=True)) == (1, 1, 1)
    fa.synchronize()
    assert _counts(lambda: repr(a)) == (0, 1, 0)  # a blocking read; its copy is not modelled


def test_ops_whose_result_the_host_reads_are_host_waits(fake_device):
    a = torch.randn(4, 4).to(fake_device)
    idx = torch.tensor([0, 2]).to(fake_device)
    assert _counts(lambda: torch.equal(a, a)) == (1, 1, 0)
    assert _counts(lambda: a.nonzero()) == (1, 1, 0)
    mask = a > 0
    assert _counts(lambda: a[mask]) == (1, 1, 0)  # boolean mask: the host reads its size
    assert _counts(lambda: a[idx]) == (1, 0, 0)  # integer indices: no wait
    # linalg.solve checks its error codes on the host (aten::_linalg_check_errors)
    m = (torch.eye(4) * 2).to(fake_device)
    assert _counts(lambda: torch.linalg.solve(m, a)) == (2, 1, 0)


def test_synchronize_and_queries_are_host_waits(fake_device):
    assert _counts(lambda: torch.fakegpu.synchronize()) == (0, 1, 0)
    assert fa.stats()["synchronizes"] == 1
    assert _counts(fa.synchronize) == (0, 1, 0)
    default = torch.fakegpu.default_stream()
    assert _counts(default.synchronize) == (0, 1, 0)
    assert _counts(default.query) == (0, 1, 0)
    e = torch.fakegpu.Event()
    assert _counts(e.query) == (0, 1, 0)  # never recorded: still a call the host makes
    assert _counts(e.synchronize) == (0, 1, 0)
    assert _counts(lambda: e.record(default)) == (0, 0, 0)
    assert _counts(e.query) == (0, 1, 0)
    assert _counts(e.synchronize) == (0, 1, 0)
    assert _counts(lambda: default.wait_event(e)) == (0, 0, 0)  # device-side ordering
    assert fa.stats()["synchronizes"] == 0  # only the device-wide synchronize counts there


def test_device_ops_and_host_waits_on_side_streams(fake_device):
    """With a side stream the ops take the modelled dispatch path: the same counts."""
    side = torch.fakegpu.Stream()
    host = torch.randn(4, 4).pin_memory()
    with torch.fakegpu.stream(side):
        assert _counts(lambda: host.to(fake_device, non_blocking=True)) == (1, 0, 1)
        dev = host.to(fake_device, non_blocking=True)
        ready = side.record_event()
    torch.fakegpu.current_stream().wait_event(ready)
    assert _counts(lambda: dev + dev) == (1, 0, 0)
    assert _counts(lambda: dev.sum().item()) == (2, 1, 1)
    assert _counts(side.query) == (0, 1, 0)
    assert _counts(side.synchronize) == (0, 1, 0)
    assert _counts(lambda: dev.record_stream(side)) == (0, 0, 0)
    assert _counts(lambda: torch.tensor([1.0], device=fake_device)) == (1, 0, 1)
    fa.synchronize()


def test_reset_stats_zeroes_device_ops_and_host_waits(fake_device):
    a = torch.ones(3, device=fake_device)
    a.sum().item()
    torch.fakegpu.synchronize()
    s = fa.stats()
    assert s["device_ops"] >= 3 and s["host_waits"] >= 2
    fa.reset_stats()
    s = fa.stats()
    assert s["device_ops"] == s["host_waits"] == 0
