"""Write detection (``core/writes.py``): the README's properties of the fingerprints, the
block fingerprint of layer mode."""

from __future__ import annotations


import pytest
import torch

from diffusion_offload.core.writes import (
    block_fingerprint,
    fingerprint,
    fingerprints,
)
from diffusion_offload.testing.pytest_plugin import requires_fake

WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _block() -> list[torch.Tensor]:
    """Large and small tensors of mixed widths, one with a tail (n not k * rows)."""
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(37, 29, generator=g),  # 1073 words: rows of 32, a tail of 49
        torch.randn(64, generator=g).to(torch.bfloat16),  # small, 2-byte words
        torch.randn(16, 16, generator=g).to(torch.float16),
        torch.randn(5, generator=g),  # small, 4-byte words
        torch.randint(-(2**62), 2**62, (40,), generator=g),  # small, 8-byte words
        torch.randn(300, generator=g).double(),
    ]


def _block_fp(tensors: list[torch.Tensor]) -> int:
    return int(block_fingerprint(tensors))


def _with_word(t: torch.Tensor, index: int, delta: int) -> torch.Tensor:
    """A copy of ``t`` with word ``index`` (of its width) changed by ``delta`` (mod 2^bits)."""
    out = t.clone()
    words = out.reshape(-1).view(WORD[t.element_size()])
    bits = 8 * t.element_size()
    value = (int(words[index]) + delta) % (1 << bits)
    words[index] = value - (1 << bits) if value >= 1 << (bits - 1) else value
    return out


@pytest.mark.parametrize("which", range(6))
def test_every_single_word_change_changes_both_fingerprints(which: int) -> None:
    block = _block()
    t = block[which]
    n = t.numel()
    ref_t, ref_b = int(fingerprint(t)), _block_fp(block)
    bits = 8 * t.element_size()
    g = torch.Generator().manual_seed(which)
    positions = range(n) if n <= 400 else torch.randint(0, n, (400,), generator=g).tolist()
    for i in positions:
        for delta in (1, 1 << (bits - 1), int(torch.randint(1, 1 << 31, (), generator=g))):
            changed = _with_word(t, i, delta)
            if torch.equal(changed.reshape(-1).view(WORD[t.element_size()]),
                           t.reshape(-1).view(WORD[t.element_size()])):
                continue  # the delta wrapped to 0 at this width
            assert int(fingerprint(changed)) != ref_t, (i, delta)
            assert _block_fp(block[:which] + [changed] + block[which + 1:]) != ref_b, (i, delta)


@pytest.mark.parametrize("axis", ["row", "column"])
def test_a_change_confined_to_one_row_or_column_is_seen(axis: str) -> None:
    t = torch.randn(40, 40)  # 1600 words: the fingerprint's view is 40 x 40
    block = [t, torch.randn(8)]
    ref_t, ref_b = int(fingerprint(t)), _block_fp(block)
    g = torch.Generator().manual_seed(1)
    for trial in range(200):
        changed = t.clone()
        line = int(torch.randint(0, 40, (), generator=g))
        target = changed[line] if axis == "row" else changed[:, line]
        target.copy_(torch.randn(40, generator=g))
        assert int(fingerprint(changed)) != ref_t, trial
        assert _block_fp([changed, block[1]]) != ref_b, trial


@pytest.mark.parametrize("axis", ["row", "column"])
def test_two_words_swapped_within_one_row_or_column_are_seen(axis: str) -> None:
    """Row sums alone miss a swap within a row, column sums one within a column: the
    fingerprints weigh both."""
    t = torch.randn(40, 40)
    block = [t, torch.randn(8)]
    ref_t, ref_b = int(fingerprint(t)), _block_fp(block)
    for line in range(0, 40, 7):
        for a, b in ((0, 1), (3, 39), (17, 18)):
            changed = t.clone()
            i, j = ((line, a), (line, b)) if axis == "row" else ((a, line), (b, line))
            changed[i], changed[j] = t[j], t[i]
            assert int(fingerprint(changed)) != ref_t, (line, a, b)
            assert _block_fp([changed, block[1]]) != ref_b, (line, a, b)


def test_equal_bytes_give_equal_fingerprints_whatever_the_tensor_object() -> None:
    block = _block()
    copies = [t.clone() for t in block]
    assert _block_fp(copies) == _block_fp(block)
    assert fingerprints(copies).tolist() == fingerprints(block).tolist()
    # a non-contiguous view fingerprints as its contiguous copy
    t = torch.randn(30, 50)
    assert int(fingerprint(t.t())) == int(fingerprint(t.t().contiguous()))


def test_the_block_fingerprint_reads_its_inputs_only() -> None:
    lone = torch.arange(10, dtype=torch.int64)  # one small 8-byte part: its own words
    before = lone.clone()
    _block_fp([lone])
    assert torch.equal(lone, before)
    block = _block()
    saved = [t.clone() for t in block]
    _block_fp(block)
    assert all(torch.equal(a, b) for a, b in zip(block, saved))


@requires_fake
def test_the_block_fingerprint_costs_two_device_ops_a_large_tensor_and_no_copy(fake_device) -> None:
    from diffusion_offload.testing import fake_accelerator as fa

    g = torch.Generator().manual_seed(3)
    large = [torch.randn(64, 64, generator=g).to(fake_device) for _ in range(10)]  # no tail
    small = [torch.randn(16, generator=g).to(fake_device) for _ in range(10)]
    block_fingerprint(large[:1] + small[:1])  # warm
    costs = []
    for n in (2, 10):
        fa.reset_stats()
        block_fingerprint(large[:n] + small)
        s = fa.stats()
        assert (s["transfers"], s["host_waits"]) == (0, 0)
        costs.append(s["device_ops"])
    assert costs[1] - costs[0] == 2 * 8  # two reductions per large tensor (a tail adds one)
    assert costs[0] <= 4 + 2 + 14  # 2 large, one word width of small ones, the block's own


@requires_fake
def test_host_and_device_compute_the_same_values(fake_device) -> None:
    block = _block()
    on_device = [t.to(fake_device) for t in block]
    assert int(block_fingerprint(on_device).cpu()) == int(block_fingerprint(block))
    assert fingerprints(on_device).cpu().tolist() == fingerprints(block).tolist()


