"""The fake device's shared mutable state: one lock and one ``state`` object.

The values the package's modules rebind (``install()`` sets ``state.installed`` and
``state.device``; a side stream or a copy bandwidth sets ``state.model_on``...) and the
containers that modules below their natural owner need (``state.streams``,
``state.deferred``) live on ``state``, read and written as ``state.<name>``: a
``from .state import <value>`` would copy the binding. This is the bottom module of the
package; it imports none of the others.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

DEVICE_TYPE = "fakegpu"

_lock = threading.RLock()


class _State:
    """What the modules of the fake device share and rebind (one instance: ``state``)."""

    device: torch.device  # set by install(); torch.device("fakegpu") needs the rename first

    def __init__(self) -> None:
        self.installed = False
        # a side stream exists or a copy bandwidth is set: ops take the model path
        self.model_on = False
        # bytes per second of host<->device copies; None: instant
        self.bandwidth: float | None = None
        # .stream: the thread's current Stream (None: the default stream); .stack: the
        # streams to restore on leaving ``stream(s)``; .host_mode: its _HostAccessMode
        self.tls = threading.local()
        # stream id -> the one Stream object with that id (streams.Stream)
        self.streams: dict[int, torch.Stream] = {}
        self.default_stream: torch.Stream | None = None  # id 0, made by install()
        self.deferred: list[str] = []  # races found at frees, raised at the next fakegpu call
        # registered by device.py when it is imported, for host_races.py (below it): the
        # tensor class of the device and the dispatch its ops take
        self.tensor_type: type | None = None
        self.dispatch: Callable[[Any, Any, Any], Any] | None = None


state = _State()


def _current() -> torch.Stream:
    s = getattr(state.tls, "stream", None)
    return state.default_stream if s is None else s  # type: ignore[return-value]
