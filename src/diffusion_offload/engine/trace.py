"""Residency and stage timelines as Chrome trace-event JSON (opens in Perfetto).

Format: ``{"traceEvents": [...]}`` (object format) with complete events (``"ph": "X"``,
``ts`` and ``dur`` in microseconds). Each component has its own ``tid`` lane with spans
named ``load``, ``resident`` and ``evict``; in layer mode a streamed component's lane
holds its blocks' ``load`` (synchronous), ``prefetch`` (queued on the copy stream: host
time only), ``release`` and ``host wait`` (a device write check's read-back) spans, each
naming its block. Lane 0 holds the stage spans (``text_encoding``, ``denoising``,
``decoding``). Thread-name metadata events label
the lanes. Reference: the Trace Event Format document of the Chromium project.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only for annotations
    from ..core.residency import ComponentWeights
    from ..core.streamer import StreamedBlock

__all__ = ["TraceRecorder"]


class TraceRecorder:
    """Collects spans from component load/evict events and engine stages."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.events: list[dict[str, Any]] = []
        self._tids: dict[str, int] = {}
        self._resident_since: dict[str, float] = {}

    def _us(self, t: float) -> float:
        return round((t - self.origin) * 1e6, 3)

    def _tid(self, lane: str) -> int:
        if lane not in self._tids:
            self._tids[lane] = len(self._tids) + 1
        return self._tids[lane]

    def span(self, name: str, lane: str, start: float, end: float, **args: Any) -> None:
        """Add a complete event ``name`` on ``lane`` from ``start`` to ``end`` (perf_counter seconds)."""
        tid = 0 if lane == "stages" else self._tid(lane)
        self.events.append({
            "name": name, "cat": lane, "ph": "X", "pid": 1, "tid": tid,
            "ts": self._us(start), "dur": round(max(end - start, 0.0) * 1e6, 3), "args": args,
        })

    def watch(self, component: ComponentWeights, resident_now: bool) -> None:
        """Record ``component``'s loads and evictions from now on."""
        if resident_now:
            self._resident_since[component.name] = time.perf_counter()
        component.listeners.append(self.on_event)

    def on_event(self, event: str, component: ComponentWeights, seconds: float) -> None:
        """Listener for ``ComponentWeights`` events (``load`` / ``evict``)."""
        end = time.perf_counter()
        start = end - seconds
        name = component.name
        if event == "load":
            self.span("load", name, start, end, bytes=component.evictable_bytes)
            self._resident_since[name] = end
        elif event == "evict":
            since = self._resident_since.pop(name, None)
            if since is not None:
                self.span("resident", name, since, start)
            self.span("evict", name, start, end)

    def on_block(self, event: str, block: StreamedBlock, start: float, end: float) -> None:
        """Listener for ``BlockStreamer`` events: a span ``event`` on the block's component
        lane, naming the block and its bytes."""
        self.span(event, block.component, start, end, block=block.name, bytes=block.nbytes)

    def to_dict(self) -> dict[str, Any]:
        """The trace as a dict; open resident spans are closed at the current time."""
        now = time.perf_counter()
        events = list(self.events)
        for name, since in self._resident_since.items():
            tid = self._tid(name)
            events.append({
                "name": "resident", "cat": name, "ph": "X", "pid": 1, "tid": tid,
                "ts": self._us(since), "dur": round((now - since) * 1e6, 3), "args": {},
            })
        meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "stages"}}]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
            for lane, tid in self._tids.items()
        ]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> None:
        """Write the trace JSON to ``path`` (atomically)."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        os.replace(tmp, path)
