"""How a write to a weight is detected: fingerprints of its bytes.

``fingerprint`` / ``fingerprints`` hash a tensor's bytes where the tensor lives (64 bits,
no host synchronisation): module mode compares them at eviction with the ones taken at
load, layer mode with the host copies' own. The host alone cannot see every write: an
in-place op on ``p.data`` (a detached alias with its own version counter) changes neither
``p._version`` nor its storage, so every check compares bytes.
"""

from __future__ import annotations

import math

import torch

__all__ = ["block_fingerprint", "fingerprint", "fingerprints"]


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# 64-bit constants (two's complement) of the splitmix64 finaliser
_K1, _K2, _K3 = -7046029254386353131, 0x632BE59BD9B4E019, -4658895280553007687


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat tensor of same-width integers (a copy only if non-contiguous).
    Called with autograd off."""
    x = t
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_contiguous():
        x = x.contiguous()
    x = x.reshape(-1)
    return x.view(_WORD[x.element_size()])


def _mix(index: torch.Tensor, salt: int) -> torch.Tensor:
    """Pseudo-random 64-bit multipliers of the positions in ``index`` (an ``int64``
    tensor, overwritten and returned): the splitmix64 finaliser of ``index * K1 + salt``."""
    h = index.mul_(_K1).add_(salt)
    h.bitwise_xor_(h >> 31).mul_(_K3)
    h.bitwise_xor_(h >> 29).mul_(_K1)
    return h


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A 64-bit fingerprint of ``t``'s bytes, computed where ``t`` lives: the block
    fingerprint of ``t`` alone (``block_fingerprint([t])``).

    The ``n`` words (the bytes read as integers of the element's width) are viewed as
    rows of ``isqrt(n)`` words, so the temporaries are about ``48 * sqrt(n)`` bytes of
    device memory (400 KiB for a 70 M-element weight); the fingerprint is
    ``sum_i r_i*a_i + sum_j c_j*b_j + sum_k t_k*d_k`` modulo 2**64, where ``r`` are the
    row sums, ``c`` the column sums, ``t`` the tail words, ``a`` and ``d`` odd and ``b``
    even position-dependent multipliers (splitmix64: about 16 device ops a tensor). The
    sums are reductions with a 64-bit accumulator, so no full-size temporary is made.

    A change of one word always changes the fingerprint (its coefficient, odd + even or
    odd, is invertible modulo 2**64), as does any change confined to one row or one
    column. A change of several words goes unseen only if the weighted sum of its row
    and column differences vanishes modulo 2**64.

    Args:
        t: any dense tensor (elements of 1, 2, 4 or 8 bytes, or complex).

    Returns:
        An ``int64`` tensor of shape ``()`` on ``t.device``; no host synchronisation.
    """
    return block_fingerprint([t])


SMALL_WORDS = 128
"""Tensors of at most this many words (biases, norms, scales) are fingerprinted together,
in batches of up to ``BATCH_WORDS`` words: a few device ops per batch instead of about
twenty per tensor, with at most ~3 KiB of temporary device memory."""
BATCH_WORDS = 128


@torch.no_grad()
def fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The fingerprints of ``tensors`` (all on one device), as one ``int64`` tensor ``(N,)``.

    Large tensors go through ``fingerprint``. Small ones (``SMALL_WORDS`` words or fewer)
    are batched: their words are concatenated (a temporary of 8 bytes per word, at most
    ``BATCH_WORDS`` words), weighted by odd multipliers of the word's index within its
    tensor and summed per tensor modulo 2**64, so any change of one word is seen. A
    tensor's fingerprint depends only on its own bytes and size class, not on the batch.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    dev = tensors[0].device
    out: list[torch.Tensor | None] = [None] * len(tensors)
    batch: list[tuple[int, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal batch, size
        if not batch:
            return
        words = torch.cat([w.to(torch.int64) for _, w in batch])
        local = torch.cat([torch.arange(w.numel(), device=dev) for _, w in batch])
        _mix(local, _K1).bitwise_or_(1)
        parts = torch.split(words.mul_(local), [w.numel() for _, w in batch])
        for (i, w), part in zip(batch, parts):
            out[i] = part.sum() + w.numel()  # + length: empty and all-zero tensors differ
        batch, size = [], 0

    for i, t in enumerate(tensors):
        w = _words(t)
        if w.numel() > SMALL_WORDS:
            out[i] = fingerprint(t)
            continue
        if size + w.numel() > BATCH_WORDS:
            flush()
        batch.append((i, w))
        size += w.numel()
    flush()
    return torch.stack(out)  # type: ignore[arg-type]


HOST_CHUNK_WORDS = 1 << 18
"""Where reductions run on CPU kernels, grid sums widen at most this many words to
``int64`` at a time (2 MiB): a CPU ``sum(dtype=int64)`` widens its whole input first, a
full-size anonymous temporary (for a host copy left on disk, ``tiers``, more than the
budget allows)."""

_WIDENING_IN_KERNEL = ("cuda", "xpu", "npu", "mps")  # accumulate in int64 without a copy


def _grid_sums(grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column sums (``int64``, modulo 2**64) of a ``rows x cols`` integer grid;
    on CPU kernels (the host, the fake accelerator) in chunks of rows
    (``HOST_CHUNK_WORDS``): equal values, since wrapping addition is associative."""
    if grid.device.type in _WIDENING_IN_KERNEL or grid.numel() <= HOST_CHUNK_WORDS:
        return grid.sum(dim=1, dtype=torch.int64), grid.sum(dim=0, dtype=torch.int64)
    rows, cols = grid.shape
    step = max(1, HOST_CHUNK_WORDS // cols)
    row_sums = torch.empty(rows, dtype=torch.int64, device=grid.device)
    col_sums = torch.zeros(cols, dtype=torch.int64, device=grid.device)
    for r in range(0, rows, step):
        part = grid[r : r + step].to(torch.int64)
        torch.sum(part, dim=1, out=row_sums[r : r + step])
        col_sums += part.sum(dim=0)
    return row_sums, col_sums


def _block_parts(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """The integer vectors a block fingerprint weighs, odd-weighted ones first, and how
    many words those are.

    Per tensor of more than ``SMALL_WORDS`` words: its row sums and column sums over the
    ``isqrt(n)``-wide view (two reductions, no full-size temporary) and its tail words;
    the small tensors' words, concatenated per word width (biases and norms: two ops per
    width, not per tensor). Rows, tails and small words get odd multipliers, columns even
    ones, as in ``fingerprint``; the column sums come last, so the parities are two ranges.
    """
    odd: list[torch.Tensor] = []
    even: list[torch.Tensor] = []
    small: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        w = _words(t)
        n = w.numel()
        if n > SMALL_WORDS:
            k = math.isqrt(n)
            rows = n // k
            row_sums, col_sums = _grid_sums(w[: rows * k].view(rows, k))
            odd.append(row_sums)
            even.append(col_sums)
            if n > rows * k:
                odd.append(w[rows * k :].to(torch.int64))
        elif n:
            small.setdefault(w.dtype, []).append(w)
    for words in small.values():
        odd.append((torch.cat(words) if len(words) > 1 else words[0]).to(torch.int64))
    return odd + even, sum(v.numel() for v in odd)


@torch.no_grad()
def block_fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One 64-bit fingerprint of all of ``tensors``' bytes (all on one device, or all on
    the host), computed where they live.

    ``sum`` over the block's row sums, tail and small-tensor words (odd multipliers) and
    column sums (even ones) of each times its own splitmix64 multiplier, modulo 2**64:
    the guarantees of ``fingerprint`` for the block as a whole (a change of one word
    always changes it, as does any change confined to one row or one column of a
    tensor's view; several words go unseen only if their weighted differences vanish
    modulo 2**64), at two device ops per large tensor, two per word width of the small
    ones and about fourteen for the block, instead of about sixteen a tensor. Nothing is
    copied between host and device. Temporaries: about 24 bytes per weighed word
    (``2 * sqrt(n)`` per large tensor, ``n`` per small one): about 2 MiB for a block of 13
    weights of 5120 x 5120.

    Returns:
        An ``int64`` tensor of shape ``()`` where the tensors live; no host synchronisation.

    Raises:
        torch.OutOfMemoryError: no device room for the temporaries.
    """
    parts, n_odd = _block_parts(tensors)
    if not parts:  # no bytes at all
        return torch.zeros((), dtype=torch.int64, device=tensors[0].device if tensors else None)
    device = parts[0].device
    values = torch.cat(parts) if len(parts) > 1 else parts[0].clone()  # (not a weight's own words)
    del parts
    coef = _mix(torch.arange(values.numel(), dtype=torch.int64, device=device), _K2)
    coef[:n_odd].bitwise_or_(1)
    coef[n_odd:].bitwise_left_shift_(1)
    return values.mul_(coef).sum()
