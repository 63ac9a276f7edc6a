"""Weighted byte sums: the hash every write check computes over a weight's bytes.

A buffer of ``n`` bytes is read as a grid of signed bytes, ``rows x width`` (``shape``),
and multiplied by a ``width x 8`` matrix of random signed bytes (``weights``) in one
integer matrix product (``torch._int_mm``: ``int8 x int8 -> int32``, exact): 8 weighted
sums per row. The last ``n - rows * width`` bytes are covered by a second, small product
over the buffer's last ``17 x cover`` bytes. Buffers under ``17 * 16`` bytes are read
back as they are (each byte one ``int32``).

Collision bound. Let a write change the buffer and not depend on the weights (the weights
are drawn from ``os.urandom`` once per process and never leave it). Take a grid row with
a changed byte ``c`` (difference ``d != 0``, ``|d| <= 255``): for each of the 8 columns,
fixing every other weight, at most one of the 256 values of ``w[c, j]`` makes that row's
weighted sum unchanged, because the sums are exact integers (``|sum| <= width * 2**14 <
2**31``, no wrap-around). So a change is missed with probability at most ``256**-8 =
2**-64``, whatever it is: a permutation of channels, a swap of two equal-sum rows, sign
flips of equal magnitude (the top bytes of two float64 words) are seen like any other
change. Plain row and column sums (the check this replaces) miss every permutation that
keeps each row and column sum (issue 38 item 3).

Cost: one (or, with a cover, two) matrix products per buffer, no full-size temporary,
``8 * width`` bytes of weights copied to the device per check and ``32 * rows`` bytes of
sums. ``width`` is about ``2 * sqrt(n)`` (at most ``MAX_WIDTH``), so a 1 GiB arena gives
16,384 rows: 512 KiB of sums. The source of the layout rules: CUDA's ``_int_mm`` needs
more than 16 rows, a width that is a multiple of 8 and an output width that is a
multiple of 8 (PyTorch ``aten/src/ATen/native/cuda/Blas.cpp``, ``_int_mm_out_cuda``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from . import hostmem
from .platform import platform_for

__all__ = ["COLUMNS", "MAX_WIDTH", "MIN_ROWS", "count_pinned", "device_weights", "pinned_weights_bytes", "shape",
           "size", "weighted_sums", "weights", "weights_bytes"]

COLUMNS = 8
"""Weighted sums per grid row (the output width of the product; CUDA needs a multiple of 8)."""

MIN_ROWS = 17
"""Fewest grid rows (CUDA's ``_int_mm`` needs more than 16); also the cover's rows."""

MAX_WIDTH = 1 << 16
"""Widest grid row in bytes: ``MAX_WIDTH * 128 * 128 = 2**30`` keeps every sum exact in int32."""

_ALIGN = 16
_weights: torch.Tensor | None = None
_pinned: torch.Tensor | None = None
_pinned_bytes = 0


def shape(nbytes: int) -> tuple[int, int, int]:
    """The ``(rows, width, cover)`` layout ``weighted_sums`` reads ``nbytes`` bytes as:
    ``rows x width`` bytes from the start (``width`` a multiple of 16, about
    ``2 * sqrt(nbytes)``, at most ``MAX_WIDTH``, with ``rows >= MIN_ROWS``) and, when
    bytes are left over, the last ``MIN_ROWS x cover`` bytes (``cover`` a multiple of 16,
    the smallest covering them). ``(0, 0, 0)``: fewer than ``MIN_ROWS * 16`` bytes, read
    as they are."""
    if nbytes < MIN_ROWS * _ALIGN:
        return 0, 0, 0
    width = min(MAX_WIDTH, nbytes // MIN_ROWS, 2 * math.isqrt(nbytes))
    width = max(_ALIGN, width - width % _ALIGN)
    rows = nbytes // width
    tail = nbytes - rows * width
    cover = 0
    if tail:
        cover = -(-tail // MIN_ROWS)
        cover += (-cover) % _ALIGN
    return rows, width, cover


def size(layout: tuple[int, int, int], nbytes: int) -> int:
    """``int32`` elements ``weighted_sums`` writes for ``nbytes`` bytes read as ``layout``."""
    rows, width, cover = layout
    if width == 0:
        return nbytes
    return COLUMNS * (rows + (MIN_ROWS if cover else 0))


def weights(width: int) -> torch.Tensor:
    """The first ``width`` rows of this process's weights: a host ``int8`` tensor
    ``(width, COLUMNS)`` of bytes drawn uniformly (``torch.randint`` seeded from
    ``os.urandom``), the same for every check in the process.

    Raises:
        ValueError: ``width`` is over ``MAX_WIDTH``.
    """
    global _weights
    if width > MAX_WIDTH:
        raise ValueError(f"width must be at most {MAX_WIDTH} bytes, got {width}")
    if _weights is None:
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
        _weights = torch.randint(-128, 128, (MAX_WIDTH, COLUMNS), dtype=torch.int8, generator=g)
    return _weights[:width]


def weights_bytes(nbytes: Iterable[int]) -> int:
    """Bytes of weights one check over buffers of these sizes (bytes each) copies to the
    device: ``COLUMNS`` per byte of the widest grid row (``shape``), 0 when every buffer
    is small enough to be read as it is."""
    return COLUMNS * max((shape(n)[1] for n in nbytes), default=0)


def device_weights(device: torch.device, width: int) -> torch.Tensor:
    """``weights(width)`` copied to ``device`` (``8 * width`` bytes, one H2D copy), from
    the process's pinned copy of the weights where the host can pin (the copy then does
    not block the host); nothing is kept on the device. The pinned copy holds a power of
    two of rows, at least ``width``, made with ``hostmem.host_buffer`` (its bytes are
    ``pinned_weights_bytes``); it is made again, larger, only when a wider check comes,
    after the device finished every copy from the old one. The host copy is never
    written, so no copy can race it."""
    global _pinned
    host = weights(MAX_WIDTH)
    if device.type == "cpu":
        return host[:width]
    if _pinned is None or _pinned.shape[0] < width:
        rows = min(MAX_WIDTH, 1 << max(width - 1, 0).bit_length())
        place = platform_for(device)
        if _pinned is not None:
            place.synchronize()  # copies from the old copy are done before it is freed
        buf = hostmem.host_buffer(rows * COLUMNS, torch.int8, place, True, _charge).view(rows, COLUMNS)
        buf.copy_(host[:rows])
        _pinned = buf
    return _pinned[:width].to(device, non_blocking=_pinned.is_pinned())


def _charge(nbytes: int) -> None:
    global _pinned_bytes
    _pinned_bytes += nbytes


def pinned_weights_bytes() -> int:
    """Pinned bytes of the process's copy of the weights now (0 before the first device
    check, or where the host cannot pin)."""
    return _pinned_bytes


def count_pinned(stats: Any) -> None:
    """Bring ``stats.shared_pinned_bytes`` to ``pinned_weights_bytes()``, the difference
    charged to its ``pinned_bytes`` (``TransferStats.charge_pinned``): every backend
    counts the one pinned copy of the weights it uses, whole. Called after each check
    that copied weights to the device."""
    delta = _pinned_bytes - stats.shared_pinned_bytes
    if delta:
        stats.shared_pinned_bytes += delta
        stats.charge_pinned(delta)


def weighted_sums(buf: torch.Tensor, layout: tuple[int, int, int], out: torch.Tensor, w: torch.Tensor) -> None:
    """Write the weighted sums of ``buf`` (a flat contiguous ``uint8`` tensor, host or
    device) read as ``layout`` (``shape(buf.numel())``) into ``out`` (``int32``,
    ``size(layout, buf.numel())`` elements, same device), with ``w`` (``weights(width)``
    or its copy on ``buf``'s device, at least ``width`` rows): one or two matrix products,
    or one copy for a small buffer; no host synchronisation."""
    rows, width, cover = layout
    if width == 0:
        out.copy_(buf)
        return
    grid = buf[: rows * width].view(torch.int8).view(rows, width)
    torch._int_mm(grid, w[:width], out=out[: COLUMNS * rows].view(rows, COLUMNS))
    if cover:
        end = buf[buf.numel() - MIN_ROWS * cover :].view(torch.int8).view(MIN_ROWS, cover)
        torch._int_mm(end, w[:cover], out=out[COLUMNS * rows :].view(MIN_ROWS, COLUMNS))
