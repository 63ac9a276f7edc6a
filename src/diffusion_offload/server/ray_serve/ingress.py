"""The HTTP ingress of ``serve --ray``: :class:`DiffusionIngress`, :class:`RayIngressState`.

Each ingress replica serves the single-process FastAPI app (:func:`~.app.build_app`: the
same routes, schemas, errors, limits, auth and metrics) over a state whose job operations
call the job index actor; it needs neither torch nor diffusers (the model's limits and
defaults come from the generators, through the index). Every response carries
``X-Ingress-Id``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError

from ..app import build_app
from ..errors import APIError
from ..jobs import Job, QueueFull, ShuttingDown
from ..metrics import HTTP_FAMILIES, ServerMetrics, merge_snapshots
from ..state import BaseServerState, ClientGone, ServerSettings, job_failure, submit_error
from .index import CALL_TIMEOUT_S, HEARTBEAT_S, NAMESPACE, _actor_name, _rank_label

__all__ = ["DiffusionIngress", "RayIngressState"]

logger = logging.getLogger("diffusion_offload.server")


class _RemoteEngine:
    """What the routes ask of the engine, for a model that runs on the generators: as
    ``Omni``'s ``is_video``, ``image_input`` (``"required"``, ``"optional"`` or None),
    ``pipeline_class`` and ``knobs_for``, from a generator's description of its model
    (``edits``: ``generator._edit_tables``'s, None when it cannot edit). It has no
    ``check_request``: the generator checks each job before it runs it
    (``ServerState.execute``), and a refusal answers the single-process server's 400."""

    def __init__(self, is_video: bool, image_input: str | None = None,
                 pipeline_class: str = "this model", edits: dict[str, Any] | None = None) -> None:
        self.is_video = is_video
        self.image_input = image_input
        self.pipeline_class = pipeline_class
        self._edits = edits

    def knobs_for(self, mask: bool) -> tuple[dict[str, Any], dict[str, str]]:
        """``(knobs, refused)`` of the pipeline that edits (``mask``: inpaints) an image.

        Raises:
            ValueError: the model has no such variant, or cannot edit images at all.
        """
        table = (self._edits or {}).get("mask" if mask else "image")
        if table is None:
            raise ValueError(f"{self.pipeline_class} cannot edit images")
        if isinstance(table, str):
            raise ValueError(table)
        return table


async def _call(ref: Any, timeout: float | None = CALL_TIMEOUT_S) -> Any:
    """Await an index call.

    Raises:
        APIError: 503 when the index is gone or does not answer in ``timeout`` seconds.
    """
    try:
        return await asyncio.wait_for(_await(ref), timeout)
    except (RayActorError, asyncio.TimeoutError):
        raise APIError(
            503, "The job index is unavailable; retry shortly.", code="index_unavailable"
        ) from None


async def _await(ref: Any) -> Any:
    return await ref


class RayIngressState(BaseServerState):
    """The state of one ingress replica: the job operations go to the :class:`~.index.JobIndex`.

    The model counts as loaded once a generator has described it (through the index);
    ``/health`` is ``failed`` if the Serve application failed to deploy before that.

    Args:
        settings: the server settings.
        index: the name of the job index actor.
    """

    def __init__(self, settings: ServerSettings, index: str) -> None:
        super().__init__(
            settings, ServerMetrics(engine=lambda: None, queue_depth=lambda: 0, running=lambda: 0)
        )
        self.index = ray.get_actor(index, namespace=NAMESPACE)
        self.actor = _actor_name()
        self.app_name = serve.get_replica_context().app_name
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def label(self) -> str:
        """``ingress-<rank>``."""
        return _rank_label("ingress")

    # -------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start watching for the model and sending heartbeats (on the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._tasks = [self._loop.create_task(self._watch_model()),
                       self._loop.create_task(self._heartbeat_loop())]

    def stop(self) -> None:
        """Stop the background tasks (any thread)."""
        self.shutting_down = True
        if self._loop is not None and not self._loop.is_closed():
            for task in self._tasks:
                self._loop.call_soon_threadsafe(task.cancel)
        try:
            self.index.forget.remote(self.label, self.actor)
        except Exception:
            pass

    async def _watch_model(self) -> None:
        checks = 0
        while self.engine is None:
            try:
                model = await _call(self.index.model.remote())
            except APIError:
                model = None
            if model is not None:
                self.rules = model["rules"]
                self.limits = model["limits"]
                self.loaded_at = int(time.time())
                self.engine = _RemoteEngine(model["is_video"], model.get("image_input"),
                                            model.get("pipeline_class", "this model"),
                                            model.get("edits"))
                return
            checks += 1
            if checks % 10 == 0 and await asyncio.to_thread(self._deploy_failed):
                self.load_error = RuntimeError("the generator deployment failed")
                return
            await asyncio.sleep(0.5)

    def _deploy_failed(self) -> bool:
        try:
            app = serve.status().applications.get(self.app_name)
        except Exception:
            return False
        return app is not None and str(getattr(app.status, "value", app.status)) == "DEPLOY_FAILED"

    async def _heartbeat_loop(self) -> None:
        while True:
            try:
                await self._beat()
            except Exception as exc:
                logger.warning("heartbeat to the job index failed: %s", exc)
            await asyncio.sleep(HEARTBEAT_S)

    async def _beat(self) -> None:
        await _call(self.index.heartbeat.remote(
            "ingress", self.label, self.actor, self.metrics.snapshot(HTTP_FAMILIES)
        ))

    # -------------------------------------------------------------- health and metrics

    async def health_report(self, authorized: bool) -> dict[str, Any]:
        """``{"status"}``; with ``authorized``, also ``"replicas"`` (the live ones)."""
        body: dict[str, Any] = {"status": self.health}
        if authorized:
            try:
                body["replicas"] = await _call(self.index.replicas.remote())
            except APIError:
                body = {"status": "failed"}  # no job index: nothing can be served
        return body

    async def render_metrics(self) -> bytes:
        """Every replica's metrics merged (this replica's counted up to now)."""
        await self._beat()
        return merge_snapshots(await _call(self.index.metric_parts.remote()))

    # -------------------------------------------------------------- jobs

    async def submit_job(self, job: Job) -> None:
        """Queue a video job on the index (429/503 as the single-process server)."""
        refused = await _call(self.index.submit.remote(job))
        if refused is not None:
            kind, message = refused
            raise submit_error(QueueFull(message) if kind == "QueueFull" else ShuttingDown(message))

    async def run_and_wait(self, job: Job, disconnected: Callable[[], Any] | None = None) -> Any:
        """Queue ``job`` on the index and wait for it; sets ``job.replica``.

        Raises:
            ClientGone: the client disconnected first (the job is cancelled if queued).
            APIError: refused (429/503), failed (:func:`~.state.job_failure`), or no index.
        """
        ref = self.index.run.remote(job)
        done = asyncio.ensure_future(_await(ref))
        gone = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        try:
            waiting = {done} if gone is None else {done, gone}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not done.done():
                ray.cancel(ref)
                raise ClientGone(job.id)
            outcome = done.result()
        except asyncio.CancelledError:
            ray.cancel(ref)
            raise
        except RayActorError:
            raise APIError(
                503, "The job index is unavailable; retry shortly.", code="index_unavailable"
            ) from None
        finally:
            if gone is not None and not gone.done():
                gone.cancel()
        if outcome[0] == "refused":
            _, kind, message = outcome
            raise submit_error(QueueFull(message) if kind == "QueueFull" else ShuttingDown(message))
        finished: Job = outcome[1]
        job.replica = finished.replica
        if finished.status == "completed":
            return finished.result
        raise job_failure(finished)

    async def get_job(self, job_id: str) -> Job | None:
        """The kept job from the index."""
        return await _call(self.index.get.remote(job_id))

    async def list_jobs(self) -> list[Job]:
        """The kept jobs from the index, oldest first."""
        return await _call(self.index.list.remote())

    async def delete_job(self, job_id: str) -> None:
        """Delete on the index (``KeyError`` as locally)."""
        outcome = await _call(self.index.delete.remote(job_id))
        if outcome == "not_found":
            raise KeyError(job_id)

    async def job_content(self, job: Job) -> bytes | None:
        """The encoded result (mp4 bytes, or a list of PNG bytes) from the object store
        (None if the job expired meanwhile)."""
        refs = await _call(self.index.content.remote(job.id))
        if refs is None:
            return None
        return await _call(refs[0], timeout=None)


class _IngressIdHeader:
    """ASGI middleware: ``X-Ingress-Id: ingress-<rank>`` on every response."""

    def __init__(self, app: Any, label: Callable[[], str]) -> None:
        self.app = app
        self.label = label

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                header = (b"x-ingress-id", self.label().encode("ascii", "replace"))
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, tagged)


@serve.ingress()
class DiffusionIngress:
    """The HTTP ingress: the single-process FastAPI app over a :class:`RayIngressState`.

    Args:
        settings: the server settings.
        index: the name of the job index actor.
        generator: the generator deployment (bound so that it is part of the application;
            the index sends it the jobs).
    """

    def __init__(self, settings: ServerSettings, index: str, generator: Any) -> None:
        self.state = RayIngressState(settings, index)

    def __serve_build_asgi_app__(self) -> Any:
        """The app, built on the replica (Serve calls this after ``__init__``)."""
        app = build_app(self.state)
        app.add_middleware(_IngressIdHeader, label=lambda: self.state.label)
        return app
