"""The write check's weighted byte sums see the writes plain row and column sums miss
(issue 38 item 3): permutations, swaps of equal-sum rows, sign flips of equal magnitude
(float64 included), on the host, on the fake device, and end to end in module mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffusion_offload import ModelLevelOffloadBackend
from diffusion_offload.core import checksum
from diffusion_offload.core.arena import ALIGN
from diffusion_offload.core.discovery import SupportsComponentDiscovery
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing.pytest_plugin import requires_fake


def _hash(t: torch.Tensor) -> torch.Tensor:
    buf = t.detach().contiguous().reshape(-1).view(torch.uint8)
    layout = checksum.shape(buf.numel())
    out = torch.empty(checksum.size(layout, buf.numel()), dtype=torch.int32, device=t.device)
    checksum.weighted_sums(buf, layout, out, checksum.weights(layout[1]).to(t.device))
    return out.cpu()


def _plain_sums(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The check this replaces: row and column sums of the 64-bit words, on a grid of the
    matrix's own rows (the old grid's rows are contiguous words too)."""
    words = t.detach().contiguous().reshape(t.shape[0], -1).view(torch.int64)
    return words.sum(1), words.sum(0)


def test_the_layout_rules():
    assert checksum.shape(271) == (0, 0, 0)  # small: read as they are
    assert checksum.size((0, 0, 0), 100) == 100
    rows, width, cover = checksum.shape(1 << 30)
    assert (rows, width, cover) == (16384, 65536, 0)
    assert checksum.size((rows, width, cover), 1 << 30) == 8 * 16384  # 512 KiB of sums
    for n in (272, 400, 4096, 15472 * 8, 134144, 10**6 + 16, 7 * 10**6 + 48):
        rows, width, cover = checksum.shape(n)
        assert width % ALIGN == 0 and width <= checksum.MAX_WIDTH and rows >= checksum.MIN_ROWS
        tail = n - rows * width
        assert 0 <= tail < width
        assert (cover == 0) == (tail == 0)
        assert cover % ALIGN == 0 and checksum.MIN_ROWS * cover >= tail
        assert checksum.MIN_ROWS * cover <= n


def _parity_perm(n: int, seed: int) -> torch.Tensor:
    """A random permutation of ``range(n)`` mapping even to even and odd to odd (so each
    float32 stays in its half of a 64-bit word)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.empty(n, dtype=torch.long)
    perm[0::2] = torch.arange(0, n, 2)[torch.randperm(n // 2, generator=g)]
    perm[1::2] = torch.arange(1, n, 2)[torch.randperm(n // 2, generator=g)]
    return perm


def _identity_permuted() -> tuple[torch.Tensor, torch.Tensor]:
    eye = torch.eye(64)
    return eye, eye[_parity_perm(64, 1)]


def _row_swap() -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    w[10] = w[3].flip(0)  # the same sum, other bytes
    v = w.clone()
    v[[3, 10]] = v[[10, 3]]
    return w, v


def _sign_flips_f64() -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(48, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    v = w.clone()
    for r, c in ((5, 7), (5, 2), (30, 7), (30, 2)):  # a rectangle of sign flips: each is
        v[r, c] = -v[r, c]  # 2**63 on its word, and two cancel in any 64-bit sum
    return w, v


def _sign_flips_small_f64() -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    v = w.clone()
    v[1], v[9] = -v[1], -v[9]
    return w, v


def _channel_swap_equal() -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(32, 96, generator=torch.Generator().manual_seed(5))
    v = w[:, torch.randperm(96, generator=torch.Generator().manual_seed(6))]
    return w, v


CASES = {
    "identity permuted": _identity_permuted,
    "equal-sum rows swapped": _row_swap,
    "float64 sign flips": _sign_flips_f64,
    "two float64 sign flips, small tensor": _sign_flips_small_f64,
    "channels permuted": _channel_swap_equal,
}


@pytest.mark.parametrize("case", list(CASES))
def test_changes_plain_sums_can_miss_are_seen_on_the_host(case):
    before, after = CASES[case]()
    assert not torch.equal(before, after)
    assert not torch.equal(_hash(before), _hash(after))
    assert torch.equal(_hash(before), _hash(before.clone()))


def test_plain_sums_miss_the_permuted_identity_and_the_sign_flips():
    """The control: the old row and column sums do not see these (the reason for item 3)."""
    for case in ("identity permuted", "float64 sign flips"):
        before, after = CASES[case]()
        a, b = _plain_sums(before), _plain_sums(after)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), case


@requires_fake
@pytest.mark.parametrize("case", list(CASES))
def test_the_device_computes_the_hosts_sums(fake_device, case):
    before, after = CASES[case]()
    assert torch.equal(_hash(before.to(fake_device)), _hash(before))
    assert torch.equal(_hash(after.to(fake_device)), _hash(after))


class _Proj(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules = ["transformer"]
    _encoder_modules = ["text_encoder"]
    _vae_modules: list[str] = []
    _resident_modules: list[str] = []

    def __init__(self) -> None:
        super().__init__()
        self.transformer = _Proj()
        self.text_encoder = _Proj()


@requires_fake
def test_a_permutation_written_while_resident_survives_eviction(fake_device):
    """Issue 38 item 3's repro: an identity projection permuted in place on the device in
    module mode is written back at eviction, and the next load brings the permuted one."""
    pipe = _Pipe()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0)).to(fake_device)
    perm = _parity_perm(64, 1)
    assert torch.equal(_plain_sums(torch.eye(64))[0], _plain_sums(torch.eye(64)[perm])[0])
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit", "text_encoder"]}, fake_device)
    backend.enable(pipe)
    try:
        with torch.no_grad():
            pipe.transformer(x)  # loads the DiT
            w = pipe.transformer.proj.weight
            assert w.device == fake_device
            w.data.copy_(w.data[perm])  # every row and column sum unchanged
            pipe.text_encoder(x)  # evicts the DiT
            assert pipe.transformer.proj.weight.device.type == "cpu"
            got = pipe.transformer(x).cpu()
        assert torch.equal(got, x.cpu()[:, perm])
        assert torch.equal(pipe.transformer.proj.weight.detach().cpu(), torch.eye(64)[perm])
        assert backend.stats.d2h_bytes == 64 * 64 * 4  # the permuted weight written back
    finally:
        backend.disable()
