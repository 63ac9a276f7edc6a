"""How a write to a weight is detected: fingerprints of its bytes.

``fingerprint`` / ``fingerprints`` hash a tensor's bytes where the tensor lives (64 bits,
no host synchronisation): the tensor's weighted byte sums (``checksum.weighted_sums``),
folded into one 64-bit value. They decide which members of an arena whose check differs
were written, and compare disk-backed host copies with what was loaded (``tiers``). The
host alone cannot see every write: an in-place op on ``p.data`` (a detached alias with
its own version counter) changes neither ``p._version`` nor its storage, so every check
compares bytes.
"""

from __future__ import annotations

import torch

from . import checksum

__all__ = ["fingerprint", "fingerprints"]


# 64-bit constants (two's complement) of the splitmix64 finaliser
_K1, _K2, _K3 = -7046029254386353131, 0x632BE59BD9B4E019, -4658895280553007687


def _mix(index: torch.Tensor, salt: int) -> torch.Tensor:
    """Pseudo-random 64-bit multipliers of the positions in ``index`` (an ``int64``
    tensor, overwritten and returned): the splitmix64 finaliser of ``index * K1 + salt``."""
    h = index.mul_(_K1).add_(salt)
    h.bitwise_xor_(h >> 31).mul_(_K3)
    h.bitwise_xor_(h >> 29).mul_(_K1)
    return h


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat ``uint8`` tensor (a copy only if non-contiguous). Called
    with autograd off."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if not x.is_contiguous():
        x = x.contiguous()
    return x.reshape(-1).view(torch.uint8)


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """A 64-bit fingerprint of ``t``'s bytes, computed where ``t`` lives: ``fingerprints([t])[0]``.

    Returns:
        An ``int64`` tensor of shape ``()`` on ``t.device``; no host synchronisation.
    """
    return fingerprints([t])[0]


SMALL_BYTES = checksum.MIN_ROWS * 16
"""Tensors under this many bytes (biases, norms, scales) are read as they are, batched."""


@torch.no_grad()
def fingerprints(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The fingerprints of ``tensors`` (all on one device), as one ``int64`` tensor ``(N,)``.

    A tensor of at least ``SMALL_BYTES`` bytes: its weighted byte sums (``checksum``: one
    or two integer matrix products, ``int32``, about ``4 * sqrt(bytes)`` of them), each
    times an odd splitmix64 multiplier of its position, summed modulo 2**64, plus its
    byte count. Smaller tensors are batched: their bytes (each one value, ``0..255``)
    weighted the same way and summed per tensor. Every value folded differs by less than
    ``2**31`` between two contents, so an odd multiplier never cancels a difference the
    way it cancels ``2**63`` (two sign flips of float64 words); a change the sums see is
    lost in the fold with probability about ``2**-33`` at most, and a change of one byte
    never. The weights (``8 * width`` bytes) are copied to the device once per call,
    from pinned memory where possible. Temporaries: about ``48 * sqrt(bytes)`` bytes per
    large tensor (the sums and their multipliers), ``16`` bytes per byte of the small ones.

    Raises:
        torch.OutOfMemoryError: no device room for the temporaries.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.int64)
    dev = tensors[0].device
    data = [_bytes(t) for t in tensors]
    layouts = [checksum.shape(b.numel()) for b in data]
    width = max(layout[1] for layout in layouts)
    w = checksum.device_weights(dev, width) if width else None
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    small: list[int] = []
    for i, (b, layout) in enumerate(zip(data, layouts)):
        if layout[1] == 0:
            small.append(i)
            continue
        sums = torch.empty(checksum.size(layout, b.numel()), dtype=torch.int32, device=dev)
        checksum.weighted_sums(b, layout, sums, w)
        coef = _mix(torch.arange(sums.numel(), dtype=torch.int64, device=dev), _K1).bitwise_or_(1)
        out[i] = coef.mul_(sums).sum() + b.numel()
    if small:
        values = torch.cat([data[i] for i in small]).to(torch.int64)
        local = torch.cat([torch.arange(data[i].numel(), dtype=torch.int64, device=dev) for i in small])
        _mix(local, _K2).bitwise_or_(1)
        parts = torch.split(values.mul_(local), [data[i].numel() for i in small])
        for i, part in zip(small, parts):
            out[i] = part.sum() + data[i].numel()  # + length: empty and all-zero tensors differ
    return torch.stack(out)
