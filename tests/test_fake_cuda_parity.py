"""The fake device accepts what CUDA accepts and refuses what CUDA refuses (issue 25, item 6).

Device scalars read back into a host tensor (``torch.tensor([t[i]])``, as diffusers'
inpainting and SVD pipelines do) are D2H reads with a host wait each, like ``.item()``;
a device tensor indexed with host indices works, other host/device mixes still raise;
``torch.autocast("fakegpu")`` casts the ops CUDA's autocast casts.
"""

from __future__ import annotations

import pytest
import torch

from diffusion_offload.testing import fake_accelerator as fa

COUNTED = ("d2h_bytes", "h2d_bytes", "transfers", "device_ops", "host_waits")


def _delta(fn):
    before = fa.stats()
    out = fn()
    after = fa.stats()
    return out, {k: after[k] - before[k] for k in COUNTED}


def test_tensor_from_device_scalars_is_a_d2h_read_per_scalar(fake_device):
    timesteps = torch.tensor([999.0, 750.0, 500.0]).to(fake_device)
    out, counted = _delta(lambda: torch.tensor([timesteps[1], timesteps[2]]))
    assert out.device.type == "cpu" and out.tolist() == [750.0, 500.0]
    scalars = [timesteps[1], timesteps[2]]
    _, items = _delta(lambda: [s.item() for s in scalars])
    # each scalar: one 4-byte D2H read, one device op, one host wait (as .item())
    assert counted == items == {"d2h_bytes": 8, "h2d_bytes": 0, "transfers": 2, "device_ops": 2, "host_waits": 2}


def test_host_indices_work_where_cuda_allows_them(fake_device):
    host = torch.arange(12.0).reshape(3, 4)
    x = host.to(fake_device)
    rows = torch.tensor([2, 0])
    mask = torch.tensor([True, False, True])
    out, counted = _delta(lambda: x[rows])
    assert out.device == fake_device and torch.equal(out.cpu(), host[rows])
    assert counted["h2d_bytes"] == rows.numel() * rows.element_size() and counted["host_waits"] == 0
    out, counted = _delta(lambda: x[mask])  # a host mask: no device nonzero, no host wait
    assert torch.equal(out.cpu(), host[mask]) and counted["host_waits"] == 0
    x[rows] = 7.0
    host[rows] = 7.0
    assert torch.equal(x.cpu(), host)
    # what CUDA refuses, the fake refuses too
    for refused in (
        lambda: torch.index_select(x, 0, rows),  # index_select wants the index on x's device
        lambda: host[rows.to(fake_device)],  # a host tensor indexed by device indices
        lambda: x + torch.ones(3, 4),  # a host operand (not 0-dim)
    ):
        with pytest.raises(RuntimeError, match="same device"):
            refused()


def test_autocast_casts_like_cuda(fake_device):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0)).to(fake_device)
    linear = torch.nn.Linear(4, 4).to(fake_device)
    with torch.autocast(fake_device.type, dtype=torch.bfloat16):
        y = linear(x)
        dtypes = (y.dtype, (x @ x.T).dtype, torch.softmax(y, -1).dtype, (x + 1).dtype)
    assert dtypes == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    expected = torch.nn.functional.linear(x.cpu().bfloat16(), linear.weight.cpu().bfloat16(),
                                          linear.bias.cpu().bfloat16())
    assert torch.equal(y.cpu(), expected)
    with torch.autocast(fake_device.type, enabled=False):
        assert linear(x).dtype == torch.float32
