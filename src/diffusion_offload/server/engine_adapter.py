"""What the server needs to know about, and do to, a loaded engine.

The server works with any object that has ``generate(prompts, SamplingParams)`` and
``is_video`` (an :class:`~diffusion_offload.engine.Omni`, or a test double); ``stats``,
``pipeline`` and ``close()`` are used when present.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ProgressTracker", "call_params", "frame_step"]


def call_params(engine: Any) -> frozenset[str] | None:
    """Keyword arguments of the pipeline's ``__call__``, or None if there is no pipeline."""
    pipeline = getattr(engine, "pipeline", None)
    if pipeline is None:
        return None
    try:
        return frozenset(inspect.signature(pipeline.__call__).parameters)
    except (TypeError, ValueError):
        return None


def frame_step(engine: Any) -> int | None:
    """``num_frames - 1`` must be a multiple of this (the VAE's temporal factor), or None."""
    value = getattr(getattr(engine, "pipeline", None), "vae_scale_factor_temporal", None)
    return int(value) if isinstance(value, int) and value > 1 else None


class ProgressTracker:
    """Denoising progress of the running job, from the pipeline's progress bar.

    diffusers pipelines open ``self.progress_bar(total=steps)`` once per call and call
    ``update()`` after every step. :meth:`install` wraps the pipeline instance's
    ``progress_bar`` so each update reports ``(outputs done + steps/total) / outputs``
    to the callback set by :meth:`begin`. Pipelines without it just report 0 until done.
    The callback may raise to stop the pipeline at a step boundary (the exception
    propagates out of the pipeline call).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callback: Callable[[float], None] | None = None
        self._outputs = 1
        self._bars = 0

    def install(self, engine: Any) -> bool:
        """Wrap ``engine.pipeline.progress_bar``; False if the engine has no such pipeline."""
        pipeline = getattr(engine, "pipeline", None)
        original = getattr(pipeline, "progress_bar", None)
        if original is None or getattr(original, "_diffusion_offload_progress", False):
            return False
        tracker = self

        def progress_bar(iterable: Any = None, total: Any = None) -> Any:
            bar = original(iterable=iterable, total=total)
            steps_total = (
                total
                if total is not None
                else (len(iterable) if hasattr(iterable, "__len__") else None)
            )
            tracker._bar_started()
            update = bar.update
            done = [0]

            def counting_update(n: int = 1) -> Any:
                done[0] += n
                if steps_total:
                    tracker._report(min(1.0, done[0] / steps_total))
                return update(n)

            bar.update = counting_update
            return bar

        progress_bar._diffusion_offload_progress = True  # type: ignore[attr-defined]
        pipeline.progress_bar = progress_bar
        return True

    def begin(self, outputs: int, callback: Callable[[float], None]) -> None:
        """Report the next run (``outputs`` pipeline calls) as percents to ``callback``."""
        with self._lock:
            self._callback = callback
            self._outputs = max(1, outputs)
            self._bars = 0

    def end(self) -> None:
        """Stop reporting."""
        with self._lock:
            self._callback = None

    def _bar_started(self) -> None:
        with self._lock:
            self._bars += 1

    def _report(self, fraction: float) -> None:
        with self._lock:
            if self._callback is None:
                return
            done = (min(self._bars, self._outputs) - 1 + fraction) / self._outputs
            self._callback(round(min(99.0, max(0.0, 100.0 * done)), 1))
