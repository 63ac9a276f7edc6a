"""The generators of ``serve --ray``: :class:`DiffusionGenerator`, one engine per replica.

Each replica (one per accelerator) loads one engine and runs the jobs the job index sends
it, one at a time, through the single-process :meth:`~.state.ServerState.execute` (the
same limits, progress reporting, encoding and metrics); it reports a kept job's start and
progress to the index and sends the index a heartbeat with its engine metrics.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import ray

from ..jobs import Job, JobAbandoned
from ..metrics import ENGINE_FAMILIES
from ..state import ServerSettings, ServerState
from .index import CALL_TIMEOUT_S, HEARTBEAT_S, NAMESPACE, _actor_name, _rank_label

__all__ = ["DiffusionGenerator"]

logger = logging.getLogger("diffusion_offload.server")


def _edit_tables(engine: Any) -> dict[str, Any] | None:
    """What ``/v1/images/edits`` needs of an image model, for the ingress (which has no
    pipeline): ``{"image": ..., "mask": ...}``, each ``engine.knobs_for(mask)``'s
    ``(knobs, refused)`` or, when the model has no such variant, the ``ValueError``'s
    message. None for a video model or an engine that cannot edit (no ``knobs_for``).
    Builds the image-to-image and inpainting variants now (they share every weight)."""
    knobs_for = getattr(engine, "knobs_for", None)
    if knobs_for is None or engine.is_video:
        return None
    tables: dict[str, Any] = {}
    for key, mask in (("image", False), ("mask", True)):
        try:
            tables[key] = knobs_for(mask)
        except ValueError as exc:
            tables[key] = str(exc)
    return tables


class DiffusionGenerator:
    """One engine on one accelerator; runs the jobs the index sends, one at a time.

    Args:
        model: the model folder or hub id (available on every node).
        config: the offload config (a mapping) or None.
        engine_options: more keyword arguments of ``build_omni`` (``device``, ``dtype``,
            ``variant``, ``max_pinned_bytes``).
        settings: the server settings (the limits, as the single-process server's).
        index: the name of the job index actor.
        engine_factory: builds the engine instead of ``build_omni`` (tests).
    """

    async def __init__(self, model: str, config: Any, engine_options: dict[str, Any],
                       settings: ServerSettings, index: str,
                       engine_factory: Callable[[], Any] | None = None) -> None:
        from ...cli_args import quiet_libraries
        from ...engine.omni import build_omni

        quiet_libraries()
        options = {"name": settings.model_id, **engine_options}  # refusals name the served id
        factory = engine_factory or functools.partial(build_omni, model, config, progress=False, **options)
        engine = await asyncio.to_thread(factory)
        self.state = ServerState(engine, settings)  # limits, progress, encoding, metrics
        self.lock = threading.Lock()
        self.running = 0
        self.index = ray.get_actor(index, namespace=NAMESPACE)
        self.actor = _actor_name()
        self.model = {
            "is_video": bool(engine.is_video),
            "image_input": getattr(engine, "image_input", None),  # image-to-video: "required"
            "pipeline_class": getattr(engine, "pipeline_class", "this model"),
            "edits": await asyncio.to_thread(_edit_tables, engine),
            "rules": self.state.rules,
            "limits": self.state.limits,
            "plan": getattr(engine, "plan_message", None),  # auto's pick, printed by the driver
        }
        await self._beat()
        self._heartbeats = asyncio.get_running_loop().create_task(self._heartbeat_loop())

    @property
    def label(self) -> str:
        """``generator-<rank>``."""
        return _rank_label("generator")

    def _beat_ref(self) -> Any:
        return self.index.heartbeat.remote(
            "generator", self.label, self.actor,
            self.state.metrics.snapshot(ENGINE_FAMILIES), self.running, self.model,
        )

    async def _beat(self) -> None:
        await asyncio.wait_for(self._beat_ref(), CALL_TIMEOUT_S)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await self._beat()
            except Exception as exc:  # the index is gone or slow: try again next time
                logger.warning("heartbeat to the job index failed: %s", exc)

    async def run(self, job: Job, attempt: int) -> dict[str, Any]:
        """Generate and encode ``job`` (a copy sent by the index).

        Returns:
            ``{"result": PNG bytes list | mp4 bytes, "replica": label}``.

        Raises:
            Whatever the engine raises (the index fails the job with it).
        """
        label = self.label
        if job.store:
            self.index.started.remote(job.id, attempt, label, self.actor)
        last = [-1.0]
        pending: list[Any] = []  # the index's answer to the last progress report

        def on_progress(percent: float) -> None:
            if not job.store:
                return
            if pending:
                ready, _ = ray.wait(pending, timeout=0)
                if not ready:
                    return  # the index has not answered the last report yet
                if ray.get(pending.pop()) is False:  # cancelled (deleted) or failed meanwhile
                    raise JobAbandoned(f"job {job.id} is no longer wanted")
            if percent - last[0] >= 1.0:
                last[0] = percent
                pending.append(self.index.progress.remote(job.id, attempt, percent))

        def work() -> Any:
            with self.lock:  # one generation at a time, even after a cancelled call
                self.running = 1
                try:
                    return self.state.execute(job, on_progress)
                finally:
                    self.running = 0

        try:
            result = await asyncio.to_thread(work)
        except Exception:
            logger.exception("job %s (attempt %d) failed on %s", job.id, attempt, label)
            raise
        finally:
            self._beat_ref()  # fresh engine metrics, not awaited
        return {"result": result, "replica": label}

    def __del__(self) -> None:
        heartbeats = getattr(self, "_heartbeats", None)
        if heartbeats is not None:
            heartbeats.cancel()
        try:
            self.index.forget.remote(self.label, self.actor)
        except Exception:
            pass
        engine = getattr(getattr(self, "state", None), "engine", None)
        if engine is not None and hasattr(engine, "close"):
            try:
                engine.close()
            except Exception:
                logger.exception("closing the engine failed")
