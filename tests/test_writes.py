"""Write detection (``core/writes.py``): the README's properties of the fingerprints, one
tensor and several at once."""

from __future__ import annotations


import pytest
import torch

from diffusion_offload.core.writes import fingerprint, fingerprints
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


def _block_fp(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(fingerprints(tensors).tolist())


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


def test_the_fingerprints_read_their_inputs_only() -> None:
    lone = torch.arange(10, dtype=torch.int64)  # one small 8-byte part: its own words
    before = lone.clone()
    _block_fp([lone])
    assert torch.equal(lone, before)
    block = _block()
    saved = [t.clone() for t in block]
    _block_fp(block)
    assert all(torch.equal(a, b) for a, b in zip(block, saved))


@requires_fake
def test_the_fingerprints_cost_a_few_device_ops_a_tensor_and_one_weights_copy(fake_device) -> None:
    from diffusion_offload.testing import fake_accelerator as fa

    g = torch.Generator().manual_seed(3)
    large = [torch.randn(64, 64, generator=g).to(fake_device) for _ in range(10)]  # no cover
    small = [torch.randn(16, generator=g).to(fake_device) for _ in range(10)]
    fingerprints(large[:1] + small[:1])  # warm
    costs = []
    for n in (2, 10):
        fa.reset_stats()
        fingerprints(large[:n] + small)
        s = fa.stats()
        assert (s["transfers"], s["host_waits"]) == (1, 0)  # the weights, not waited for
        costs.append(s["device_ops"])
    per_large = (costs[1] - costs[0]) / 8
    assert per_large <= 14, costs  # the product, the fold's multipliers, the sum
    assert costs[0] <= 2 * per_large + 5 * len(small), costs  # the small ones batched: about 4 each


@requires_fake
def test_host_and_device_compute_the_same_values(fake_device) -> None:
    block = _block()
    on_device = [t.to(fake_device) for t in block]
    assert fingerprints(on_device).cpu().tolist() == fingerprints(block).tolist()




def _flip(t: torch.Tensor, *where: tuple[int, ...]) -> torch.Tensor:
    out = t.clone()
    for i in where:
        out[i] = -out[i]
    return out


@pytest.mark.parametrize(
    "case",
    ["float64 sign flips, small", "float64 sign flips, large", "permuted channels", "swapped equal-sum rows"],
)
def test_changes_that_cancel_in_64_bit_sums_change_the_fingerprint(case: str) -> None:
    """Issue 38 item 5b: two sign flips of float64 words each change their word by 2**63,
    which any odd multiplier cancels in pairs; item 3: permutations keep plain sums."""
    g = torch.Generator().manual_seed(7)
    if case == "float64 sign flips, small":
        t = torch.randn(16, dtype=torch.float64, generator=g)
        changed = _flip(t, (1,), (9,))
    elif case == "float64 sign flips, large":
        t = torch.randn(48, 48, dtype=torch.float64, generator=g)
        changed = _flip(t, (5, 7), (30, 2))
    elif case == "permuted channels":
        t = torch.eye(64)
        changed = t[:, torch.randperm(64, generator=g)]
    else:
        t = torch.randn(64, 64, generator=g)
        t[10] = t[3].flip(0)
        changed = t.clone()
        changed[[3, 10]] = changed[[10, 3]]
    assert not torch.equal(t, changed)
    assert int(fingerprint(changed)) != int(fingerprint(t))
    assert int(fingerprint(t.clone())) == int(fingerprint(t))
