"""Idle release: once the server has run no job for ``--idle-release`` seconds, every model
is put to sleep (its weights evicted to the host, no device-to-host copy of an unmodified
weight), so the device is free for other processes; the next request wakes the model it
needs. ``release`` is also what ``POST /v1/models/{id}/release`` does on demand.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

__all__ = ["IdleRelease", "NotSleepable", "release"]

logger = logging.getLogger("diffusion_offload.server")


class NotSleepable(RuntimeError):
    """The served engine keeps no host copy of what rests on the device: ``serve`` it
    with ``--idle-release`` or beside another model to make it sleepable."""


def release(engine: Any, model: str | None) -> int:
    """Put ``model`` (None: every model) of ``engine`` to sleep; the weight bytes freed.
    Waits for a running job (the engines' own locks).

    Raises:
        KeyError (``UnknownModelError``): a pool does not serve ``model``.
        NotSleepable: a single engine that was not built sleepable.
    """
    if hasattr(engine, "release"):  # a ModelPool
        return engine.release(model)
    backend = getattr(engine, "backend", None)
    if backend is None or not backend.mover.keep_host:
        raise NotSleepable("this model keeps no host copy of its resident weights (VAEs, unselected "
                           "components); serve it with --idle-release, or beside other models")
    return 0 if engine.asleep else engine.sleep()


class IdleRelease:
    """A daemon thread that calls ``release(engine(), None)`` once the server has been idle
    (no job queued or running) for ``seconds``, once per idle period.

    Args:
        seconds: the idle time, > 0.
        engine: returns the loaded engine (None while loading).
        busy: returns whether a job is queued or running.
        last_activity: returns the ``time.monotonic()`` of the last job's end (or start).
    """

    def __init__(self, seconds: float, engine: Any, busy: Any, last_activity: Any) -> None:
        self.seconds = seconds
        self._engine, self._busy, self._last = engine, busy, last_activity
        self._stop = threading.Event()
        self._released_at: float | None = None
        self.releases = 0
        self._thread = threading.Thread(target=self._run, name="diffusion-offload-idle", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.seconds / 4)):
            engine = self._engine()
            last = self._last()
            if engine is None or self._busy() or self._released_at == last:
                continue
            if time.monotonic() - last < self.seconds:
                continue
            try:
                freed = release(engine, None)
            except NotSleepable:
                return
            except Exception:  # noqa: BLE001 - logged; the next request still runs
                logger.exception("idle release failed")
                continue
            self._released_at = last
            self.releases += 1
            logger.info("idle for %g s: released %d weight bytes from the device", self.seconds, freed)
