"""Many replicas on Ray Serve: ``diffusion-offload serve MODEL --ray``.

The same HTTP API as the single-process server (the same FastAPI app: routes, schemas,
errors, limits, auth, metrics), scaled out over Ray Serve::

      clients ──HTTP──> Serve proxy ──> DiffusionIngress  (N replicas, 0 CPU, no torch)
                                          │  the FastAPI app of build_app(RayIngressState)
                                          ▼
                     named actor  "diffusion_offload_jobs:<app>"  (JobIndex, one)
                        JobManager: FIFO, max_queue, TTL, max_stored_jobs,
                        one worker thread per generator replica; video bytes in
                        the object store
                                          │  DeploymentHandle: Serve queues and routes
                                          ▼
                     DiffusionGenerator  (one replica per accelerator: num_gpus=1, or the
                        custom resource "diffusion_offload_device" on CPU machines)
                        one Omni each, max_ongoing_requests=1, autoscaling on queue length

- **Ingress** (:class:`DiffusionIngress`): :func:`~.app.build_app` over a
  :class:`RayIngressState`, whose job operations call the index actor. It needs neither
  torch nor diffusers: limits and defaults come from the generators (through the index).
  Every response carries ``X-Ingress-Id``; image responses and video downloads carry
  ``X-Replica-Id``, the generator that made them.
- **Job index** (:class:`JobIndex`, a detached named actor): the single-process
  :class:`~.jobs.JobManager` with ``workers`` = the most generator replicas, so jobs
  keep the single-process semantics (arrival order, ``--max-queue``, ``--job-ttl``,
  ``--max-stored-jobs``, each job finished and counted once) whichever ingress replica
  received them. A worker sends its job to the generator deployment; a replica that dies
  mid-job (``RayActorError``) gets the job retried once (Serve routes it to a live
  replica), then it fails with code ``replica_failed``. Results of video jobs are put in
  the object store (owned by the index, freed when the job expires or is deleted).
- **Generator** (:class:`DiffusionGenerator`): loads one engine, runs one job at a time
  (``max_ongoing_requests=1``; Serve queues the rest) through the single-process
  :meth:`~.state.ServerState.execute` (the same progress reporting, encoding, peak-memory
  metric), reports progress of video jobs to the index.
- **Replicas and metrics**: every replica sends a heartbeat to the index every
  :data:`HEARTBEAT_S` seconds with its metrics snapshot. Labels are Serve's replica ranks
  (``generator-0``, ``ingress-1``: 0 to the replica count - 1, reused when a replica is
  replaced), so series stay bounded. ``/metrics`` merges the job counters (the index's),
  the engine counters (one series per generator) and the HTTP counters (one per ingress).
  ``/health`` lists the live replicas to a caller with a valid key (or anyone without a
  key set).

Importing this module imports Ray; the plain ``serve`` command never does.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from .app import bind_socket, build_app, fail
from .jobs import IN_PROGRESS, Job, JobAbandoned, JobInProgress, JobManager, QueueFull, ShuttingDown
from .metrics import ENGINE_FAMILIES, HTTP_FAMILIES, JOB_FAMILIES, ServerMetrics, merge_snapshots
from .state import (
    BaseServerState,
    ClientGone,
    ServerSettings,
    ServerState,
    job_error_code,
    job_error_message,
    job_failure,
    submit_error,
)
from .errors import APIError

__all__ = [
    "DEVICE_RESOURCE",
    "HEARTBEAT_S",
    "DiffusionGenerator",
    "DiffusionIngress",
    "JobIndex",
    "RayIngressState",
    "ReplicaLost",
    "build_application",
    "deploy",
    "index_name",
    "serve_ray",
    "undeploy",
]

logger = logging.getLogger("diffusion_offload.server")

DEVICE_RESOURCE = "diffusion_offload_device"
"""Custom Ray resource a generator replica takes (1) when it does not take a GPU."""
NAMESPACE = "diffusion_offload"
"""Ray namespace of the job index actors."""
GENERATOR = "DiffusionGenerator"
INGRESS = "DiffusionIngress"
HEARTBEAT_S = 2.0
"""Seconds between replica heartbeats (metrics snapshots) to the index."""
STALE_S = 10.0
"""A replica not heard from for this long is gone (left out of /health and /metrics)."""
CALL_TIMEOUT_S = 10.0
"""Longest wait for a quick call to the index (everything but waiting for a job)."""


def index_name(app_name: str) -> str:
    """The name of the job index actor of Serve application ``app_name``."""
    return f"diffusion_offload_jobs:{app_name}"


class ReplicaLost(RuntimeError):
    """The generator replica running a job died, and so did (or could not start) the retry."""

    error_code = "replica_failed"


def _copy_job(job: Job, result: Any = None) -> Job:
    """A picklable copy of ``job`` (no callbacks) carrying ``result``."""
    out = copy.copy(job)
    out._callbacks = []
    out.result = result
    return out


def _rank_label(role: str) -> str:
    """``"<role>-<rank>"`` for this Serve replica (bounded: ranks run 0..replicas-1)."""
    context = serve.get_replica_context()
    rank = getattr(getattr(context, "rank", None), "rank", None)
    if rank is None:  # an older Serve without ranks: the unique tag (still one per replica)
        rank = context.replica_tag
    return f"{role}-{rank}"


def _actor_name() -> str:
    return ray.get_runtime_context().get_actor_name() or ""


# ---------------------------------------------------------------------- job index


class JobIndex:
    """The shared job state: a :class:`~.jobs.JobManager` behind a named Ray actor.

    Created (detached, named :func:`index_name`) by :func:`deploy` before the Serve
    application; every ingress and generator replica finds it by name.

    Args:
        settings: the server settings (queue size, TTL, stored-job cap).
        app_name: the Serve application whose ``DiffusionGenerator`` runs the jobs.
        workers: jobs sent to the generators at once (the most generator replicas).
    """

    def __init__(self, settings: ServerSettings, app_name: str, workers: int) -> None:
        self.settings = settings
        self.app_name = app_name
        self.metrics = ServerMetrics(
            engine=lambda: None,
            queue_depth=lambda: self.jobs.queue_depth,
            running=lambda: self.jobs.running_count,
        )
        self.jobs = JobManager(
            self._dispatch,
            settings.max_queue,
            on_finish=self.metrics.observe_job,
            error_code=job_error_code,
            error_message=job_error_message,
            job_ttl=settings.job_ttl,
            max_stored=settings.max_stored_jobs,
            workers=workers,
        )
        self._handle: Any = None
        self._handle_lock = threading.Lock()
        self._live: dict[str, Job] = {}  # job id -> job being dispatched
        self._attempt: dict[str, int] = {}
        self._history: dict[str, list[dict[str, Any]]] = {}
        self._replicas: dict[str, dict[str, Any]] = {}
        self._model: dict[str, Any] | None = None
        self.jobs.start()

    # -------------------------------------------------------------- dispatch (worker threads)

    def _generator(self) -> Any:
        with self._handle_lock:
            if self._handle is None:
                self._handle = serve.get_deployment_handle(GENERATOR, app_name=self.app_name)
            return self._handle

    def _dispatch(self, job: Job) -> Any:
        """JobManager runner: run ``job`` on a generator replica, retried once if the
        replica dies. Video results go to the object store (a ref is kept)."""
        handle = self._generator()
        sent = _copy_job(job)
        self._live[job.id] = job
        try:
            for attempt in (1, 2):
                self._attempt[job.id] = attempt
                try:
                    out = handle.run.remote(sent, attempt).result()
                except RayActorError as exc:
                    if job.status != IN_PROGRESS:  # failed meanwhile (shutdown grace)
                        raise JobAbandoned(job.id) from None
                    logger.warning("job %s: its generator replica died (attempt %d): %s",
                                   job.id, attempt, str(exc).splitlines()[0])
                    if job.store:
                        self._history.setdefault(job.id, []).append(
                            {"attempt": attempt, "lost": True}
                        )
                    if attempt == 2:
                        raise ReplicaLost(f"job {job.id}: generator replica lost twice") from exc
                    job.progress = 0.0
                    continue
                except RayTaskError as exc:  # the job itself failed on the replica
                    cause = getattr(exc, "cause", None)
                    if isinstance(cause, BaseException):
                        raise cause from None
                    raise
                job.replica = out["replica"]
                result = out["result"]
                return ray.put(result) if job.store else result
        finally:
            self._live.pop(job.id, None)
            self._attempt.pop(job.id, None)
        raise AssertionError("unreachable")

    # -------------------------------------------------------------- jobs (the ingress)

    async def run(self, job: Job) -> tuple:
        """Queue a job that the caller waits for (images); returns ``("done", job)`` with
        the finished job and its result, or ``("refused", kind, message)``. Cancelling
        this call cancels the job if it has not started."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        job.add_done_callback(
            lambda _: loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))
        )
        try:
            self.jobs.submit(job)
        except (QueueFull, ShuttingDown) as exc:
            return ("refused", type(exc).__name__, str(exc))
        try:
            await done
        except asyncio.CancelledError:
            if self.jobs.cancel(job, "the client disconnected before the job started"):
                logger.info("job %s cancelled: its client disconnected", job.id)
            raise
        return ("done", _copy_job(job, job.result))

    def submit(self, job: Job) -> tuple | None:
        """Queue a kept (video) job; None, or ``(kind, message)`` when refused."""
        try:
            self.jobs.submit(job)
        except (QueueFull, ShuttingDown) as exc:
            return (type(exc).__name__, str(exc))
        kept = {j.id for j in self.jobs.list()}  # forget the attempts of expired jobs
        for job_id in [k for k in self._history if k not in kept]:
            del self._history[job_id]
        return None

    def get(self, job_id: str) -> Job | None:
        """A copy of a kept job without its result (None: unknown, deleted or expired)."""
        job = self.jobs.get(job_id)
        return None if job is None else _copy_job(job)

    def list(self) -> list[Job]:
        """Copies of the kept jobs, oldest first."""
        return [_copy_job(job) for job in self.jobs.list()]

    def delete(self, job_id: str) -> str:
        """``"deleted"``, ``"not_found"`` or ``"in_progress"``."""
        try:
            self.jobs.delete(job_id)
        except KeyError:
            return "not_found"
        except JobInProgress:
            return "in_progress"
        self._history.pop(job_id, None)
        return "deleted"

    def content(self, job_id: str) -> list | None:
        """``[ref]`` of a completed job's bytes in the object store, or None."""
        job = self.jobs.get(job_id)
        if job is None or job.result is None:
            return None
        return [job.result]

    def job_attempts(self, job_id: str) -> list[dict[str, Any]]:
        """The attempts at a kept job: ``{"attempt", "replica", "actor"}`` when started,
        ``{"attempt", "lost": True}`` when its replica died."""
        return list(self._history.get(job_id, []))

    # -------------------------------------------------------------- generators

    def started(self, job_id: str, attempt: int, replica: str, actor: str) -> None:
        """A generator replica started attempt ``attempt`` of a kept job."""
        job = self._live.get(job_id)
        if job is None or self._attempt.get(job_id) != attempt:
            return
        job.replica = replica
        self._history.setdefault(job_id, []).append(
            {"attempt": attempt, "replica": replica, "actor": actor}
        )

    def progress(self, job_id: str, attempt: int, percent: float) -> None:
        """Progress of the running attempt of a kept job (stale attempts are ignored)."""
        job = self._live.get(job_id)
        if job is not None and job.status == IN_PROGRESS and self._attempt.get(job_id) == attempt:
            job.progress = float(percent)

    # -------------------------------------------------------------- replicas and metrics

    def heartbeat(self, role: str, label: str, actor: str, snapshot: list,
                  running: int = 0, model: dict | None = None) -> None:
        """A replica is alive: its role, label (``generator-0``), actor name, metrics
        snapshot, running jobs, and (generators) what the model accepts."""
        self._replicas[label] = {
            "role": role, "actor": actor, "seen": time.monotonic(),
            "snapshot": snapshot, "running": running,
        }
        if model is not None and self._model is None:
            self._model = model

    def forget(self, label: str, actor: str) -> None:
        """A replica shut down gracefully."""
        entry = self._replicas.get(label)
        if entry is not None and entry["actor"] == actor:
            del self._replicas[label]

    def model(self) -> dict | None:
        """``{"is_video", "rules", "limits"}`` from the first generator, or None yet."""
        return self._model

    def _alive(self) -> list[tuple[str, dict[str, Any]]]:
        cutoff = time.monotonic() - STALE_S
        for label in [k for k, v in self._replicas.items() if v["seen"] < cutoff]:
            del self._replicas[label]
        return sorted(self._replicas.items())

    def replicas(self) -> list[dict[str, Any]]:
        """The live replicas: ``{"id", "role", "actor", "running", "last_seen_s"}``."""
        now = time.monotonic()
        return [
            {"id": label, "role": e["role"], "actor": e["actor"], "running": e["running"],
             "last_seen_s": round(now - e["seen"], 2)}
            for label, e in self._alive()
        ]

    def metric_parts(self) -> list[tuple[dict[str, str], list]]:
        """``(labels, snapshot)`` for :func:`~.metrics.merge_snapshots`: the job families
        (unlabelled), a ``diffusion_offload_replicas{role}`` gauge, and each live
        replica's own families labelled ``replica``."""
        alive = self._alive()
        counts = {"generator": 0, "ingress": 0}
        for _, entry in alive:
            counts[entry["role"]] = counts.get(entry["role"], 0) + 1
        gauge = ("diffusion_offload_replicas", "Live replicas by role (Ray Serve).", "gauge", "",
                 [("diffusion_offload_replicas", {"role": role}, float(n))
                  for role, n in sorted(counts.items())])
        parts: list[tuple[dict[str, str], list]] = [
            ({}, self.metrics.snapshot(JOB_FAMILIES) + [gauge])
        ]
        parts += [({"replica": label}, entry["snapshot"]) for label, entry in alive]
        return parts

    # -------------------------------------------------------------- shutdown

    def begin_shutdown(self, grace: float) -> None:
        """Refuse new jobs, fail the queued ones, give the running ones ``grace`` seconds."""
        self.jobs.begin_shutdown(grace)

    def running(self) -> int:
        """Jobs being run now."""
        return self.jobs.running_count


# ---------------------------------------------------------------------- generator


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
        from ..cli_args import quiet_libraries
        from ..engine.omni import build_omni

        quiet_libraries()
        factory = engine_factory or functools.partial(
            build_omni, model, config, progress=False, **engine_options
        )
        engine = await asyncio.to_thread(factory)
        self.state = ServerState(engine, settings)  # limits, progress, encoding, metrics
        self.lock = threading.Lock()
        self.running = 0
        self.index = ray.get_actor(index, namespace=NAMESPACE)
        self.actor = _actor_name()
        self.model = {
            "is_video": bool(engine.is_video),
            "rules": self.state.rules,
            "limits": self.state.limits,
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

        def on_progress(percent: float) -> None:
            if job.store and percent - last[0] >= 1.0:
                last[0] = percent
                self.index.progress.remote(job.id, attempt, percent)

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


# ---------------------------------------------------------------------- ingress


class _RemoteEngine:
    """What the routes ask of the engine, for a model that runs on the generators."""

    def __init__(self, is_video: bool) -> None:
        self.is_video = is_video


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
    """The state of one ingress replica: the job operations go to the :class:`JobIndex`.

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
                self.engine = _RemoteEngine(model["is_video"])
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
        """Delete on the index (``KeyError`` / ``JobInProgress`` as locally)."""
        outcome = await _call(self.index.delete.remote(job_id))
        if outcome == "not_found":
            raise KeyError(job_id)
        if outcome == "in_progress":
            raise JobInProgress(job_id)

    async def job_content(self, job: Job) -> bytes | None:
        """The mp4 from the object store (None if the job expired meanwhile)."""
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


# ---------------------------------------------------------------------- deployment


def build_application(
    model: str,
    settings: ServerSettings,
    *,
    app_name: str = "diffusion-offload",
    config: Any = None,
    engine_options: dict[str, Any] | None = None,
    replicas: int = 1,
    autoscale: tuple[int, int] | None = None,
    ingress_replicas: int = 1,
    use_gpus: bool = False,
    engine_factory: Callable[[], Any] | None = None,
) -> Any:
    """The Serve application (ingress bound to the generator), not yet deployed.

    Args:
        model: model folder or hub id, as every generator will load it.
        settings: the server settings.
        app_name: the Serve application name (the job index is :func:`index_name` of it).
        config: offload config mapping (``DiffusionOffloadConfig.to_dict()``) or None.
        engine_options: ``device``, ``dtype``, ``variant``, ``max_pinned_bytes``.
        replicas: fixed generator replica count (ignored with ``autoscale``).
        autoscale: ``(min, max)`` generator replicas, scaled on queue length (Serve's
            ``target_ongoing_requests`` = 1: one running job per replica).
        ingress_replicas: HTTP ingress replicas.
        use_gpus: generators take ``num_gpus=1``; else the custom resource
            :data:`DEVICE_RESOURCE`.
        engine_factory: builds each generator's engine (tests); default ``build_omni``.

    Raises:
        ValueError: counts out of range.
    """
    if replicas < 1 or ingress_replicas < 1:
        raise ValueError("replicas and ingress_replicas must be >= 1")
    if autoscale is not None and not 1 <= autoscale[0] <= autoscale[1]:
        raise ValueError(f"autoscale must be (min, max) with 1 <= min <= max, got {autoscale}")
    actor_options: dict[str, Any] = {"num_cpus": 0}
    if use_gpus:
        actor_options["num_gpus"] = 1
    else:
        actor_options["resources"] = {DEVICE_RESOURCE: 1}
    generator_options: dict[str, Any] = {
        "name": GENERATOR,
        "max_ongoing_requests": 1,
        "ray_actor_options": actor_options,
        "graceful_shutdown_timeout_s": settings.shutdown_grace + 5.0,
    }
    if autoscale is not None:
        generator_options["autoscaling_config"] = {
            "min_replicas": autoscale[0],
            "max_replicas": autoscale[1],
            "target_ongoing_requests": 1,
            "upscale_delay_s": 3.0,
            "downscale_delay_s": 120.0,
        }
    else:
        generator_options["num_replicas"] = replicas
    generator = serve.deployment(DiffusionGenerator).options(**generator_options).bind(
        model, config, dict(engine_options or {}), settings, index_name(app_name), engine_factory
    )
    ingress = serve.deployment(DiffusionIngress).options(
        name=INGRESS,
        num_replicas=ingress_replicas,
        max_ongoing_requests=max(100, 4 * settings.max_queue),
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(settings, index_name(app_name), generator)


def deploy(application: Any, settings: ServerSettings, *, app_name: str = "diffusion-offload",
           workers: int = 1, blocking_timeout_s: float | None = None) -> Any:
    """Start the job index and deploy ``application`` (from :func:`build_application`)
    under ``app_name`` at route prefix ``/``; returns once every replica is up.

    Ray must be initialized and Serve started (``serve.start(http_options=...)``). A job
    index left by an earlier run under the same name is replaced.

    Args:
        workers: jobs the index sends to the generators at once (the most replicas).

    Returns:
        The job index actor handle.

    Raises:
        RuntimeError: the application failed to deploy (Serve's message).
    """
    name = index_name(app_name)
    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass
    index = ray.remote(JobIndex).options(
        name=name, namespace=NAMESPACE, lifetime="detached", num_cpus=0, max_restarts=0,
        max_concurrency=1000,
    ).remote(settings, app_name, workers)
    ray.get(index.model.remote())  # constructed
    serve.run(application, name=app_name, route_prefix="/")
    return index


def undeploy(app_name: str = "diffusion-offload", grace: float = 30.0) -> None:
    """Shut ``app_name`` down: refuse new jobs, give running ones up to ``grace`` seconds,
    delete the Serve application and the job index."""
    name = index_name(app_name)
    try:
        index = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        index = None
    if index is not None:
        try:
            ray.get(index.begin_shutdown.remote(grace), timeout=CALL_TIMEOUT_S)
            deadline = time.monotonic() + grace
            while ray.get(index.running.remote(), timeout=CALL_TIMEOUT_S) and time.monotonic() < deadline:
                time.sleep(0.2)
        except Exception as exc:
            logger.warning("the job index did not shut down cleanly: %s", exc)
    try:
        serve.delete(app_name)
    except Exception as exc:
        logger.warning("deleting the Serve application failed: %s", exc)
    if index is not None:
        ray.kill(index, no_restart=True)


# ---------------------------------------------------------------------- CLI


def _bounded(fn: Callable[[], Any], timeout: float, what: str) -> bool:
    """Run ``fn`` on a daemon thread for at most ``timeout`` seconds; False if it did not
    return (a cluster whose processes were killed can leave Ray calls waiting forever)."""
    thread = threading.Thread(target=fn, name=f"diffusion-offload-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        logger.warning("%s did not finish within %g s; exiting without it", what, timeout)
        return False
    return True


def _device_plan(args: argparse.Namespace, gpus: float) -> bool:
    """True when generators take GPUs (``--device cuda``, or no ``--device`` and the
    cluster has GPUs)."""
    device = (args.device or "").lower()
    if device.startswith("cuda"):
        return True
    return not device and gpus > 0


def serve_ray(args: argparse.Namespace) -> int:
    """Run ``diffusion-offload serve MODEL --ray``; returns the exit status.

    Validates like the plain ``serve`` (settings, config, model files, the address), then
    starts a local Ray cluster (or joins ``--ray-address``), deploys the application and
    serves until SIGINT/SIGTERM: new jobs are then refused, running ones get
    ``--shutdown-grace`` seconds, and the application and its job index are deleted.
    A bad value prints one line ``diffusion-offload: error: ...`` and returns 2. Every
    shutdown step is bounded: if the cluster's own processes were killed too (SIGTERM to
    the whole process group), the command still exits.
    """
    from ..cli_args import CliError, parse_config_args, quiet_libraries

    try:
        settings = ServerSettings.from_args(args)
        config = parse_config_args(args)
    except (CliError, ValueError) as exc:
        return fail(str(exc))
    quiet_libraries()
    from pathlib import Path

    from ..engine import ModelError
    from ..models.files import inspect_model, resolve_model
    from ..engine.omni import parse_dtype

    try:
        parse_dtype(args.dtype)
        model_dir = resolve_model(args.model)
        inspect_model(model_dir, getattr(args, "variant", None))
    except (ModelError, ValueError, TypeError) as exc:
        return fail(str(exc))
    try:
        bind_socket(args.host, args.port).close()  # free now; Serve's proxy binds it
    except ValueError as exc:
        return fail(str(exc))
    # a local folder by absolute path; a hub id as given (each node resolves it)
    model = str(model_dir.resolve()) if Path(args.model).is_dir() else args.model
    autoscale = tuple(args.autoscale) if args.autoscale else None
    local = not args.ray_address
    wanted = autoscale[1] if autoscale else (args.replicas or 1)
    init: dict[str, Any] = {"address": args.ray_address or "local", "include_dashboard": False,
                            "logging_level": logging.WARNING}
    if local and not str(args.device or "").lower().startswith("cuda"):
        init["resources"] = {DEVICE_RESOURCE: wanted}
    try:
        ray.init(**init)
    except Exception as exc:  # cannot connect, or cannot start
        return fail(f"--ray-address {args.ray_address!r}: cannot connect ({exc})" if args.ray_address
                     else f"--ray: cannot start a local Ray cluster ({exc})")
    try:
        resources = ray.cluster_resources()
        gpus = float(resources.get("GPU", 0))
        use_gpus = _device_plan(args, gpus)
        if not args.replicas and not autoscale:
            args.replicas = max(1, int(gpus)) if use_gpus else 1
        need = autoscale[0] if autoscale else args.replicas
        have = gpus if use_gpus else float(resources.get(DEVICE_RESOURCE, 0))
        what = "GPUs" if use_gpus else f"'{DEVICE_RESOURCE}' resources"
        flag = f"--autoscale {autoscale[0]}:{autoscale[1]}" if autoscale else f"--replicas {args.replicas}"
        if need > have:
            hint = ("" if use_gpus else
                    f"; start nodes with ray start --resources='{{\"{DEVICE_RESOURCE}\": 1}}' "
                    "(one per device), or use GPUs with --device cuda")
            return fail(f"{flag}: the Ray cluster has {have:g} {what}, fewer than the {need} "
                         f"generator replicas asked for{hint}")
        serve.start(http_options={"host": args.host, "port": args.port})
        engine_options = {"device": "cuda" if use_gpus else args.device, "dtype": args.dtype,
                          "variant": getattr(args, "variant", None),
                          "max_pinned_bytes": getattr(args, "max_pinned_memory", None)}
        budget = getattr(args, "device_memory_budget", None)
        if budget is not None:  # as plain serve: each replica applies it to its own device
            engine_options["device_memory_budget"] = budget
        app_name = "diffusion-offload"
        application = build_application(
            model, settings, app_name=app_name,
            # "auto" stays "auto": each replica plans for its own device
            config=config.to_dict() if hasattr(config, "to_dict") else config,
            engine_options=engine_options, replicas=args.replicas or 1, autoscale=autoscale,
            ingress_replicas=args.ingress_replicas or 1, use_gpus=use_gpus,
        )
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set())
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                deploy(application, settings, app_name=app_name, workers=wanted)
            except RuntimeError as exc:
                undeploy(app_name, grace=0)
                message = " ".join(str(exc).split())
                return fail(f"the application failed to deploy: {message[:2000]}")
            count = f"{autoscale[0]}-{autoscale[1]} (autoscaled)" if autoscale else str(args.replicas)
            print(f"diffusion-offload: serving {args.model} at http://{args.host}:{args.port} on Ray "
                  f"Serve: {count} generator replica(s), {args.ingress_replicas or 1} ingress "
                  "replica(s); Ctrl-C to stop", file=sys.stderr, flush=True)
            while not stop.wait(1.0):
                pass
            print(f"diffusion-offload: stopping (running jobs get up to {settings.shutdown_grace:g} s)",
                  file=sys.stderr, flush=True)
            clean = _bounded(lambda: undeploy(app_name, grace=settings.shutdown_grace),
                             settings.shutdown_grace + 15.0, "undeploy")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if local and clean:
            clean = _bounded(serve.shutdown, 15.0, "serve-shutdown")
        return 0
    finally:
        if not _bounded(ray.shutdown, 15.0, "ray-shutdown"):
            logging.shutdown()
            sys.stderr.flush()
            os._exit(1)
