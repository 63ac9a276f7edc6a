"""Sizes in bytes: parsing (``"40GiB"`` -> 42949672960) and printing (``"1.50 GiB"``).

Torch-free and below everything that prints or reads a size (the CLI, the planner, the
server), so ``--help`` and config errors stay fast.
"""

from __future__ import annotations

import re

__all__ = ["human_bytes", "parse_bytes"]


_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


def parse_bytes(text: str) -> int:
    """A size such as ``"40GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1048576"`` in bytes.

    Binary units (KiB, MiB, GiB, TiB, and the short K, M, G, T) are powers of 1024;
    decimal units (kB, MB, GB, TB) powers of 1000; no unit or ``B`` means bytes.

    Raises:
        ValueError: not a number >= 0 with one of those units.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size; use bytes or a number with a unit: KiB, MiB, GiB, TiB "
            "(powers of 1024) or kB, MB, GB, TB (powers of 1000), e.g. '40GiB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``"512 B"``, ``"17.3 MiB"``, ``"1.50 GiB"``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(n)} B"
            return f"{n:.2f} {unit}" if abs(n) < 10 else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
