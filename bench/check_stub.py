"""Diagnostic: our write detection stubbed out, to see what it costs on a device.

Inside ``write_checks_off()`` nothing is checked and every resident weight counts as
unchanged: module mode's arena sums are not recorded (``checks.record``) nor compared
(``checks.changed``), and layer mode's block release judges nothing
(``BlockStreamer._changed``). Only for benchmarks: a weight written on the device is then
lost at its eviction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from diffusion_offload.core import checks
from diffusion_offload.core.streamer import BlockStreamer

__all__ = ["write_checks_off"]


@contextlib.contextmanager
def write_checks_off(on: bool = True) -> Iterator[None]:
    """Stub the write checks out for the duration (``on=False``: leave them as they are)."""
    if not on:
        yield
        return
    real = (BlockStreamer._changed, checks.changed, checks.record)
    BlockStreamer._changed = lambda self, block, slots, members, unchanged: [False] * len(members)
    checks.changed = lambda stats, pairs, platform: [False] * len(pairs)
    checks.record = lambda stats, arena, payload, platform: None
    try:
        yield
    finally:
        BlockStreamer._changed, checks.changed, checks.record = real
