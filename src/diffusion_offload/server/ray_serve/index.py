"""The job index of ``serve --ray``: the :class:`JobIndex` actor and how replicas reach it.

One detached named actor per Serve application (:func:`index_name`, in :data:`NAMESPACE`)
holds the single-process :class:`~.jobs.JobManager`: the queue, the kept video jobs and
their results (refs into the object store), the attempts of each job, and the replicas'
heartbeats with their metrics. Its workers send each job to the generator deployment and
retry it once when the replica dies (:class:`ReplicaLost` after that). Also here, shared
by the generator and ingress replicas that talk to it: the call timeout, the heartbeat
period, and the replica labels and actor names they report.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError, RayTaskError

from ..jobs import (
    IN_PROGRESS,
    Job,
    JobAbandoned,
    JobManager,
    QueueFull,
    ShuttingDown,
)
from ..metrics import JOB_FAMILIES, ServerMetrics
from ..state import ServerSettings, job_error_code, job_error_message

__all__ = [
    "CALL_TIMEOUT_S",
    "GENERATOR",
    "HEARTBEAT_S",
    "NAMESPACE",
    "STALE_S",
    "JobIndex",
    "ReplicaLost",
    "index_name",
]

logger = logging.getLogger("diffusion_offload.server")

NAMESPACE = "diffusion_offload"
"""Ray namespace of the job index actors."""
GENERATOR = "DiffusionGenerator"
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

    Created (detached, named :func:`index_name`) by :func:`~.deployment.deploy` before the Serve
    application; every ingress and generator replica finds it by name.

    Args:
        settings: the server settings (queue size, TTL, stored-job cap).
        app_name: the Serve application whose ``DiffusionGenerator`` runs the jobs.
        workers: jobs sent to the generators at once (the most generator replicas).
    """

    def __init__(self, settings: ServerSettings, app_name: str, workers: int) -> None:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # its handle's INFO lines
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
        """``"deleted"`` or ``"not_found"`` (a running job is cancelled: its replica stops
        at its next step, told so by :meth:`progress`)."""
        try:
            self.jobs.delete(job_id)
        except KeyError:
            return "not_found"
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

    def progress(self, job_id: str, attempt: int, percent: float) -> bool:
        """Progress of the running attempt of a kept job (stale attempts are ignored).

        Returns:
            False once the job is no longer wanted (cancelled, or failed by the shutdown
            grace): the replica stops at its next step.
        """
        job = self._live.get(job_id)
        if job is None or job.status != IN_PROGRESS:
            return False
        if self._attempt.get(job_id) == attempt:
            job.progress = float(percent)
        return True

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
        """``{"is_video", "image_input", "pipeline_class", "edits", "rules", "limits", "plan"}``
        from the first generator, or None yet (``plan``: the line
        ``diffusion_offload_config="auto"`` logged for its pick)."""
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
        (unlabelled), a ``diffusion_offload_replicas{role}`` gauge, a
        ``diffusion_offload_replica_heartbeat_age_seconds{replica,role}`` gauge (seconds;
        one series per live replica, so an ingress that has answered nothing yet is still
        listed), and each live replica's own families labelled ``replica``."""
        alive = self._alive()
        counts = {"generator": 0, "ingress": 0}
        for _, entry in alive:
            counts[entry["role"]] = counts.get(entry["role"], 0) + 1
        gauge = ("diffusion_offload_replicas", "Live replicas by role (Ray Serve).", "gauge", "",
                 [("diffusion_offload_replicas", {"role": role}, float(n))
                  for role, n in sorted(counts.items())])
        now = time.monotonic()
        age = ("diffusion_offload_replica_heartbeat_age_seconds",
               "Seconds since each live replica's last heartbeat (Ray Serve); every live replica "
               "has this series, also one that has not answered a request yet.", "gauge", "",
               [("diffusion_offload_replica_heartbeat_age_seconds",
                 {"replica": label, "role": entry["role"]}, round(now - entry["seen"], 3))
                for label, entry in alive])
        parts: list[tuple[dict[str, str], list]] = [
            ({}, self.metrics.snapshot(JOB_FAMILIES) + [gauge, age])
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
