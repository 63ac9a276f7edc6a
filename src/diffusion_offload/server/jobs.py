"""A bounded job queue served by worker threads, and the store of video jobs.

One pipeline per process: every generation (image requests too) is a :class:`Job` run by
the single worker, one at a time, in arrival order. (The Ray Serve job index runs one
worker per generator replica: ``JobManager(workers=N)`` runs up to N jobs at once, still
started in arrival order.) ``max_queue`` bounds the jobs
*waiting* (the running one is not counted); :meth:`JobManager.submit` raises
:class:`QueueFull` beyond it.

States: ``queued -> in_progress -> completed | failed``. A queued or running job can be
cancelled (deleted): it never runs, or stops at its next step. On shutdown, :meth:`JobManager.begin_shutdown` refuses new jobs, fails
the queued ones, and gives the running one ``grace`` seconds before marking it failed;
its late result, if any, is dropped.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COMPLETED",
    "FAILED",
    "IN_PROGRESS",
    "QUEUED",
    "Job",
    "JobAbandoned",
    "JobManager",
    "QueueFull",
    "ShuttingDown",
]

logger = logging.getLogger("diffusion_offload.server")

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
FINISHED = (COMPLETED, FAILED)


class QueueFull(Exception):
    """``max_queue`` jobs are already waiting."""


class ShuttingDown(Exception):
    """The server is shutting down and takes no new jobs."""


class JobAbandoned(Exception):
    """Raised by a runner that notices its job was marked failed (shutdown) to stop early."""


@dataclass(eq=False)
class Job:
    """One generation.

    Attributes:
        kind: ``"image"`` or ``"video"``.
        payload: what the runner needs (the validated request and sampling params).
        store: keep the job after it finishes (video jobs) so it can be polled.
        id: ``video_<hex>`` / ``image_<hex>``.
        status: ``queued``, ``in_progress``, ``completed`` or ``failed``.
        progress: percent done, 0-100 (set by the runner while it runs).
        error: ``{"code", "message"}`` when failed (and ``"param"`` when the failure
            names a refused request field).
        result: the runner's return value when completed.
        created_at, started_at, completed_at: Unix times (seconds).
        passed_over: times a later job of another group ran before it while it waited
            (``JobManager``'s ``max_reorder`` bounds it).
        replica: which replica ran it (``generator-0``...) under Ray Serve; None in a
            single process.
    """

    kind: str
    payload: Any = None
    store: bool = False
    id: str = ""
    status: str = QUEUED
    progress: float = 0.0
    error: dict[str, str] | None = None
    result: Any = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    completed_at: float | None = None
    replica: str | None = None
    passed_over: int = 0
    _callbacks: list[Callable[[Job], None]] = field(default_factory=list, repr=False)
    _fired: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{self.kind}_{secrets.token_hex(12)}"

    @property
    def finished(self) -> bool:
        """True once completed or failed."""
        return self.status in FINISHED

    def add_done_callback(self, fn: Callable[[Job], None]) -> None:
        """Call ``fn(job)`` once the job finishes (at once if it already has); any thread."""
        if self._fired:
            fn(self)
        else:
            self._callbacks.append(fn)

    def _fire(self) -> None:
        if self._fired:
            return
        self._fired = True
        for fn in self._callbacks:
            try:
                fn(self)
            except Exception:  # a callback must never kill the worker
                logger.exception("job %s: done callback failed", self.id)
        self._callbacks.clear()


class JobManager:
    """Bounded FIFO of jobs, worker threads (one by default), and the store of kept jobs.

    Args:
        runner: ``runner(job) -> result``, run in the worker thread; an exception fails
            the job with ``"<ExceptionType>: <message>"``.
        max_queue: most jobs waiting (the running job not counted).
        on_finish: called once with every finished job (metrics), in the finishing thread.
        error_code: ``error_code(exc) -> str``, the ``code`` of a failed job's error.
        error_message: ``error_message(job, exc) -> str``, the ``message`` of a failed
            job's error as the client sees it (default ``"<ExceptionType>: <message>"``);
            the exception itself is always logged.
        job_ttl: seconds a finished kept job stays retrievable (None: forever).
        max_stored: most kept jobs; the oldest finished ones are dropped first.
        workers: worker threads, so at most this many jobs run at once (default 1: one
            pipeline, one job at a time).
        group_of: ``group_of(job)`` -> its group (a served model's id); with
            ``max_reorder``, a waiting job of the group that started last may run before
            older ones (a model swap saved).
        max_reorder: most times a waiting job may be passed over that way (0: first in,
            first out). A job passed over ``max_reorder`` times runs next.
    """

    def __init__(
        self,
        runner: Callable[[Job], Any],
        max_queue: int,
        on_finish: Callable[[Job], None] | None = None,
        error_code: Callable[[BaseException], str] | None = None,
        error_message: Callable[[Job, BaseException], str] | None = None,
        job_ttl: float | None = None,
        max_stored: int | None = None,
        workers: int = 1,
        group_of: Callable[[Job], Any] | None = None,
        max_reorder: int = 0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if isinstance(max_reorder, bool) or not isinstance(max_reorder, int) or max_reorder < 0:
            raise ValueError(f"max_reorder must be an integer >= 0, got {max_reorder!r}")
        self.group_of = group_of
        self.max_reorder = max_reorder
        self._last_group: Any = None
        self.runner = runner
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.error_code = error_code or (lambda exc: "generation_failed")
        self.error_message = error_message or (lambda job, exc: f"{type(exc).__name__}: {exc}")
        self.job_ttl = job_ttl
        self.max_stored = max_stored
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._store: dict[str, Job] = {}
        self._running: list[Job] = []
        self._accepting = True
        self._stopping = False
        self.workers = workers
        self._workers: list[threading.Thread] = []
        self._reaper: threading.Thread | None = None

    # ------------------------------------------------------------------ queue

    @property
    def queue_depth(self) -> int:
        """Jobs waiting to run."""
        return len(self._waiting)

    @property
    def running(self) -> Job | None:
        """The job the worker is running (the oldest running one with several workers)."""
        running = self._running
        return running[0] if running else None

    @property
    def running_count(self) -> int:
        """Jobs running now (0 to ``workers``)."""
        return len(self._running)

    @property
    def accepting(self) -> bool:
        """False once shutdown began."""
        return self._accepting

    def start(self) -> None:
        """Start the worker threads (idempotent)."""
        with self._cond:
            if not self._workers:
                for i in range(self.workers):
                    name = "diffusion-offload-worker" + (f"-{i}" if self.workers > 1 else "")
                    worker = threading.Thread(target=self._work, name=name, daemon=True)
                    self._workers.append(worker)
                    worker.start()

    def submit(self, job: Job) -> Job:
        """Queue ``job``.

        Raises:
            ShuttingDown: shutdown began.
            QueueFull: ``max_queue`` jobs are waiting.
        """
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} jobs waiting); retry later")
            if job.store:
                self._prune(room=1)
                if self.max_stored is not None and len(self._store) >= self.max_stored:
                    raise QueueFull(
                        f"{len(self._store)} video jobs are queued or running, the most this "
                        "server keeps (--max-stored-jobs); retry later"
                    )
            self._waiting.append(job)
            if job.store:
                self._store[job.id] = job
            self._cond.notify_all()
        return job

    def _prune(self, room: int = 0) -> None:
        """Drop expired finished jobs, then the oldest finished ones until ``room`` more
        fit under ``max_stored`` (caller holds the lock)."""
        if self.job_ttl is not None:
            cutoff = time.time() - self.job_ttl
            for job_id, job in list(self._store.items()):
                if job.finished and (job.completed_at or 0.0) <= cutoff:
                    del self._store[job_id]
        if self.max_stored is not None:
            excess = len(self._store) + room - self.max_stored
            if excess > 0:
                finished = sorted((j for j in self._store.values() if j.finished),
                                  key=lambda j: (j.completed_at or 0.0, j.created_at))
                for job in finished[:excess]:
                    del self._store[job.id]

    def get(self, job_id: str) -> Job | None:
        """A kept job by id (None when unknown, deleted or expired)."""
        with self._cond:
            self._prune()
            return self._store.get(job_id)

    def list(self) -> list[Job]:
        """Kept jobs, oldest first (expired ones dropped)."""
        with self._cond:
            self._prune()
            return sorted(self._store.values(), key=lambda j: j.created_at)

    @property
    def stored(self) -> int:
        """Number of kept jobs (after dropping expired ones)."""
        with self._cond:
            self._prune()
            return len(self._store)

    def delete(self, job_id: str) -> Job:
        """Cancel a queued or running job, or forget a finished one; the id is gone at once.

        A running job is marked failed (``cancelled``); its runner stops at its next step
        (:class:`JobAbandoned`) and its late result, if any, is dropped.

        Raises:
            KeyError: no such kept job.
        """
        with self._cond:
            self._prune()
            job = self._store.get(job_id)
            if job is None:
                raise KeyError(job_id)
            cancelled = not job.finished
            if job.status == QUEUED:
                self._waiting.remove(job)
                self._fail(job, "cancelled", "the job was cancelled before it started")
            elif job.status == IN_PROGRESS:
                self._fail(job, "cancelled", "the job was cancelled while it ran")
            del self._store[job_id]
            self._cond.notify_all()
        if cancelled:  # a finished job was counted when it finished
            self._finish_outside_lock(job)
        return job

    def cancel(self, job: Job, message: str = "the request was cancelled before the job started") -> bool:
        """Drop ``job`` if it is still queued (its caller went away); True if dropped."""
        with self._cond:
            if job.status != QUEUED:
                return False
            self._waiting.remove(job)
            self._store.pop(job.id, None)
            self._fail(job, "cancelled", message)
        self._finish_outside_lock(job)
        return True

    # ------------------------------------------------------------------ worker

    def _fail(self, job: Job, code: str, message: str) -> None:
        if job.finished:  # never finish (or count) a job twice
            return
        job.status = FAILED
        job.error = {"code": code, "message": message}
        job.completed_at = time.time()

    def _finish_outside_lock(self, job: Job) -> None:
        if self.on_finish is not None:
            try:
                self.on_finish(job)
            except Exception:
                logger.exception("job %s: on_finish failed", job.id)
        release = getattr(job.payload, "release_inputs", None)  # a kept job keeps no upload
        if callable(release):
            try:
                release()
            except Exception:
                logger.exception("job %s: releasing its inputs failed", job.id)
        job._fire()

    def _next(self) -> Job:
        """Take the job to run next (caller holds the lock, the queue is not empty): the
        oldest, unless a job of the group that started last waits behind it and no job
        ahead of that one was passed over ``max_reorder`` times already; the jobs it
        passes count one more pass each."""
        waiting = self._waiting
        if self.group_of is not None and self.max_reorder:
            last = self._last_group
            for k, job in enumerate(waiting):
                if job.passed_over >= self.max_reorder:
                    break  # it runs next: take the oldest (it or one before it)
                if self.group_of(job) == last:
                    for ahead in list(waiting)[:k]:
                        ahead.passed_over += 1
                    del waiting[k]
                    return job
        job = waiting.popleft()
        if self.group_of is not None:
            self._last_group = self.group_of(job)
        return job

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._next()
                job.status = IN_PROGRESS
                job.started_at = time.time()
                self._running.append(job)
            error: BaseException | None = None
            result = None
            try:
                result = self.runner(job)
            except BaseException as exc:  # noqa: BLE001 - every failure fails the job, never the worker
                error = exc
            with self._cond:
                self._running.remove(job)
                ours = job.status == IN_PROGRESS  # not already failed by the shutdown reaper
                if ours:
                    if error is None:
                        job.status = COMPLETED
                        job.result = result
                        job.progress = 100.0
                        job.completed_at = time.time()
                    else:
                        try:
                            message = self.error_message(job, error)
                        except Exception:
                            message = "the job failed; the server log has the details"
                        self._fail(job, self.error_code(error), message)
                        field = getattr(error, "field", None)  # a refused field: the 400's param
                        if isinstance(field, str) and job.error is not None:
                            job.error["param"] = field
                        logger.error("job %s failed: %s: %s", job.id, type(error).__name__, error)
                else:
                    logger.warning("job %s stopped after it was marked failed (%s); its result "
                                   "is dropped", job.id, (job.error or {}).get("code"))
                self._cond.notify_all()
            if ours:
                self._finish_outside_lock(job)

    # ------------------------------------------------------------------ shutdown

    def begin_shutdown(self, grace: float) -> None:
        """Stop accepting, fail the queued jobs, and give the running ones ``grace`` seconds.

        Returns at once (idempotent); a reaper thread marks the running jobs failed if
        they are still running after ``grace`` seconds.
        """
        with self._cond:
            if not self._accepting:
                return
            self._accepting = False
            self._stopping = True
            cancelled = list(self._waiting)
            self._waiting.clear()
            for job in cancelled:
                self._fail(job, "server_shutdown", "the server shut down before the job started")
            self._cond.notify_all()
            deadline = time.monotonic() + max(0.0, grace)
            self._reaper = threading.Thread(
                target=self._reap,
                args=(deadline, grace),
                name="diffusion-offload-reaper",
                daemon=True,
            )
            self._reaper.start()
        for job in cancelled:
            self._finish_outside_lock(job)

    def _reap(self, deadline: float, grace: float) -> None:
        with self._cond:
            while self._running and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            late = [job for job in self._running if job.status == IN_PROGRESS]
            for job in late:
                self._fail(
                    job,
                    "server_shutdown",
                    f"the server shut down: the job did not finish within the {grace:g} s "
                    "shutdown grace",
                )
                logger.error(
                    "job %s marked failed: still running after the %g s shutdown grace",
                    job.id, grace,
                )
        for job in late:
            self._finish_outside_lock(job)

    def abandon_running(self, message: str) -> list[Job]:
        """Mark every running job failed now (``server_shutdown``, ``message``), as the
        grace's end would; their late results are dropped. Returns those jobs."""
        with self._cond:
            late = [job for job in self._running if job.status == IN_PROGRESS]
            for job in late:
                self._fail(job, "server_shutdown", message)
            self._cond.notify_all()
        for job in late:
            self._finish_outside_lock(job)
        return late

    def shutdown(self, grace: float, settle: float = 1.0) -> bool:
        """Shut down: ``begin_shutdown(grace)``, then wait for the worker.

        Waits for the running jobs up to the grace deadline, then up to ``settle`` more
        seconds for the workers to return from jobs marked failed (runners stop
        cooperatively at their next step; one still inside a long native call is left
        behind).

        Returns:
            True if the workers have stopped (no generation still running).
        """
        self.begin_shutdown(grace)
        if self._reaper is not None:
            self._reaper.join()
        return self.join(settle)

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the worker threads to stop; True if they have."""
        deadline = time.monotonic() + timeout
        for worker in list(self._workers):
            worker.join(timeout=max(0.0, deadline - time.monotonic()))
        return not any(worker.is_alive() for worker in self._workers)
