"""The peak host memory of a request: resident anonymous and file-backed bytes.

A host budget bounds the host copies; what a user's container limit sees is the process's
resident memory, anonymous (``RssAnon``: host copies, written weights, the allocator's
heap) and file-backed (``RssFile``: mapped file pages, e.g. weights read through their
memory maps). Peers report only the device peak (issue 34 item 5). Linux only
(``/proc/self/status``, proc(5)); elsewhere nothing is reported.
"""

from __future__ import annotations

import threading
from pathlib import Path

__all__ = ["PeakHostMemory", "rss"]

_STATUS = Path("/proc/self/status")
_FIELDS = {"RssAnon": "rss_anon_bytes", "RssFile": "rss_file_bytes"}


def rss() -> dict[str, int]:
    """``{"rss_anon_bytes", "rss_file_bytes"}`` of this process now, in bytes; ``{}``
    where ``/proc/self/status`` cannot be read."""
    try:
        text = _STATUS.read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in _FIELDS:
            out[_FIELDS[key]] = int(value.split()[0]) * 1024  # kB
    return out


class PeakHostMemory:
    """The peak of each ``rss()`` field while the ``with`` body runs: a daemon thread
    samples every ``interval`` seconds (default 10 ms), and once more at entry and exit.
    A peak shorter than the interval can be missed: it is a sampled peak.

    Attributes:
        peak: ``{"rss_anon_bytes", "rss_file_bytes"}`` (bytes), ``{}`` off Linux.
    """

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for key, value in rss().items():
            self.peak[key] = max(self.peak.get(key, 0), value)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> "PeakHostMemory":
        self._sample()
        if self.peak:
            self._thread = threading.Thread(target=self._run, name="diffusion-offload-rss", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
