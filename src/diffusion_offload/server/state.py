"""Server settings and state: the engine (loaded in the background), the jobs, the metrics.

:class:`BaseServerState` is what the routes and middleware use: settings, limits, health,
and the job operations (``submit_job``, ``get_job``, ``list_jobs``, ``delete_job``,
``job_content``, ``run_and_wait``) as coroutines. :class:`ServerState` implements them in
one process (a local engine, the :class:`~.jobs.JobManager`); the Ray Serve ingress
(:mod:`.ray_serve`) implements them over a shared job index actor.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from .engine_adapter import ProgressTracker
from .errors import APIError
from .jobs import (
    COMPLETED,
    IN_PROGRESS,
    QUEUED,
    Job,
    JobAbandoned,
    JobManager,
    QueueFull,
    ShuttingDown,
)
from .metrics import ServerMetrics
from .schemas import Limits
from .addresses import check_api_key, normalize_host, normalize_origin
from .idle import IdleRelease
from .served import ServedModel, describe, engine_views, model_limits, route

__all__ = [
    "DEFAULT_FPS", "SHUTDOWN_SETTLE", "BaseServerState", "JobSpec", "RequestRefused",
    "ServerSettings", "ServerState", "check_api_key", "job_failure", "normalize_host",
    "normalize_origin", "random_seed", "refusal_error", "submit_error",
]

logger = logging.getLogger("diffusion_offload.server")


class ClientGone(Exception):
    """The client disconnected while its request waited; nothing is sent back."""


class RequestRefused(ValueError):
    """The engine refused a request (``Omni.check_request``'s ``ValueError``), in the
    words the client gets: ``message``, ``field`` (the 400's ``param``, or None).

    Raised by :meth:`ServerState.execute` before it generates, so a job that a generator
    replica refuses (``serve --ray``, whose ingress has no pipeline to check with) fails
    with the 400 the single-process server answers when the request arrives. It pickles
    with its message and field (Ray sends it from the replica to the job index).

    Args:
        message: the client's message.
        field: the refused field, or None.
    """

    error_code = "invalid_value"

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:  # the refusal's own code (admission: ``admission_refused``)
            self.error_code = code

    @classmethod
    def of(cls, exc: ValueError) -> RequestRefused:
        """The refusal of the engine's ``exc``: a ``KnobError``'s or ``AdmissionError``'s own
        message, field (and code), else ``"Invalid request: the model refused it: ..."``
        with the pipeline's message."""
        if isinstance(exc, cls):
            return exc
        field = getattr(exc, "field", None)
        code = getattr(exc, "error_code", None)
        return cls(str(exc) if field else f"Invalid request: the model refused it: {exc}", field,
                   code if isinstance(code, str) else None)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.message, self.field, self.error_code)


def refusal_error(exc: ValueError) -> APIError:
    """The 400 of a request the engine refused (``exc`` from ``check_request``): a
    ``KnobError``'s own message and field, else ``"Invalid request: the model refused
    it: ..."`` with the pipeline's message."""
    refused = RequestRefused.of(exc)
    return APIError(400, refused.message, param=refused.field, code=refused.error_code)

_MAX_SEED = 2**31 - 1
DEFAULT_FPS = 16
"""Frames per second of a video job that gives no ``fps``."""
SHUTDOWN_SETTLE = 1.0
"""Seconds a job marked failed at the shutdown grace's end gets to return from its step
before ``serve`` exits without it (so ``serve`` exits within grace + this + a little)."""


MAX_FRAMES_SECONDS = 12
"""The default ``--max-frames`` admits this many seconds at :data:`DEFAULT_FPS`."""


def default_max_frames(settings: ServerSettings, step: int | None) -> int:
    """``--max-frames``, or when not set :data:`MAX_FRAMES_SECONDS` at :data:`DEFAULT_FPS`
    rounded up to a count the model accepts (``num_frames - 1`` a multiple of ``step``)."""
    if settings.max_frames is not None:
        return settings.max_frames
    frames = MAX_FRAMES_SECONDS * DEFAULT_FPS
    return frames + 1 if step else frames


def random_seed() -> int:
    """A seed for a request that gives none."""
    return secrets.randbelow(_MAX_SEED)


@dataclass
class ServerSettings:
    """Settings of one server (the ``serve`` flags).

    Attributes:
        model_id: the model as given on the command line (the id in ``/v1/models``); with
            several models, the first one's id.
        model_ids: every served model's id, in order (default: ``(model_id,)``).
        idle_release: seconds without a job after which every model is put to sleep
            (``idle.IdleRelease``); None: never.
        max_reorder: most times a waiting job may be passed over by a later job of the
            model that ran last (saving a swap; ``JobManager``); 0: first in, first out.
        api_key: bearer token required on ``/v1/`` routes, or None.
        max_queue: most jobs waiting (the running one not counted); more answer 429.
        max_pixels: largest ``width * height`` of a request (default 2 MP: OpenAI's
            1536x1024 and 1792x1024 fit, 2048x2048 does not).
        max_frames: most frames per video; None: 12 s at :data:`DEFAULT_FPS` in frames
            the model accepts (193 for Wan).
        max_steps: most denoising steps per request.
        max_body_bytes: largest request body; more answer 413.
        shutdown_grace: seconds the running job gets on shutdown before it is marked failed.
        size_multiple: width and height must be multiples of this; None: the model's own
            rule (VAE scale factor times patch size, read from its config files).
        host: the address the server is bound to (for the ``Host`` check).
        allowed_origins: browser origins (``scheme://host[:port]``) allowed besides the
            server's own.
        allowed_hosts: ``Host`` names accepted besides the bound address and ``localhost``.
        job_ttl: seconds a finished video job is kept.
        max_stored_jobs: most video jobs kept (oldest finished dropped first).
        max_connections: most open client connections (:mod:`.connections`); None: 1000,
            or what the open-file limit leaves room for when that is less.
        timeout_keep_alive: seconds an idle connection is kept between requests.
        timeout_headers: seconds a request's line and headers may take to arrive.
        timeout_body: seconds a request's body may take to arrive after its headers.
    """

    model_id: str
    api_key: str | None = None
    max_queue: int = 32
    max_pixels: int = 2_097_152
    max_frames: int | None = None
    max_steps: int = 100
    max_body_bytes: int = 1_048_576
    shutdown_grace: float = 30.0
    size_multiple: int | None = None
    host: str = "127.0.0.1"
    allowed_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    job_ttl: float = 3600.0
    max_stored_jobs: int = 100
    max_connections: int | None = None
    timeout_keep_alive: float = 5.0
    timeout_headers: float = 10.0
    timeout_body: float = 30.0
    model_ids: tuple[str, ...] = ()
    idle_release: float | None = None
    max_reorder: int = 4

    def __post_init__(self) -> None:
        self.model_ids = tuple(self.model_ids) or (self.model_id,)
        value = self.idle_release
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
            raise ValueError(f"--idle-release must be a number of seconds > 0, got {value!r}")
        for name, minimum in (
            ("max_queue", 1),
            ("max_reorder", 0),
            ("max_pixels", 1),
            ("max_frames", 1),
            ("max_steps", 1),
            ("max_body_bytes", 1),
            ("size_multiple", 1),
            ("max_stored_jobs", 1),
            ("max_connections", 1),
        ):
            value = getattr(self, name)
            if value is None and name in ("size_multiple", "max_connections", "max_frames"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be an integer >= {minimum}, got {value!r}"
                )
        for name in ("shutdown_grace", "job_ttl"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a number >= 0, got {value!r}")
        for name in ("timeout_keep_alive", "timeout_headers", "timeout_body"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"--{name.replace('_', '-')} must be a number of seconds > 0, got {value!r}")
        if self.api_key is not None:
            check_api_key(self.api_key)
        self.allowed_origins = tuple(normalize_origin(o) for o in self.allowed_origins)
        self.allowed_hosts = tuple(normalize_host(h, "--allowed-hosts") for h in self.allowed_hosts)

    @classmethod
    def from_args(cls, args: argparse.Namespace, model_ids: tuple[str, ...] = ()) -> ServerSettings:
        """Settings from the parsed ``serve`` arguments; ``model_ids``: the served models'
        ids (default: ``MODEL`` as given).

        Raises:
            ValueError: a limit out of range.
        """
        names = {f.name for f in fields(cls)} - {"model_id", "model_ids", "allowed_origins", "allowed_hosts"}
        values = {
            name: getattr(args, name) for name in names if getattr(args, name, None) is not None
        }
        for name in ("allowed_origins", "allowed_hosts"):
            text = getattr(args, name, None) or ""
            values[name] = tuple(p.strip() for p in text.split(",") if p.strip())
        ids = tuple(model_ids) or (str(args.model),)
        return cls(model_id=ids[0], model_ids=ids, **values)


@dataclass
class JobSpec:
    """What the worker needs to run a job.

    Attributes:
        prompt: the engine's prompt item (text, or ``{"prompt", "negative_prompt"}``).
        params: its ``SamplingParams``.
        fps: a video's frame rate (None: :data:`DEFAULT_FPS`).
        size: the request's ``size`` as given, for the video object.
        seconds: the request's ``seconds`` as given (``"4"``), echoed by the video object.
        image_format: ``png``, ``jpeg`` or ``webp`` (images).
        compression: ``output_compression`` 0-100, or None (the encoder's default).
        model: the id of the served model that runs it (None: the one model).
    """

    prompt: Any
    params: Any
    fps: int | None = None
    size: str | None = None
    seconds: str | None = None
    image_format: str = "png"
    compression: int | None = None
    model: str | None = None

    def release_inputs(self) -> None:
        """Drop the prompt's decoded images (``image``, ``mask``: an edit's or an
        ``input_reference``), keeping its text; called once the job has finished, so a
        kept job does not hold them for ``--job-ttl``."""
        if isinstance(self.prompt, dict) and ("image" in self.prompt or "mask" in self.prompt):
            self.prompt = {k: v for k, v in self.prompt.items() if k not in ("image", "mask")}


def job_error_code(exc: BaseException) -> str:
    """The ``error.code`` of a job failed with ``exc``."""
    code = getattr(exc, "error_code", None)  # an exception that names its own code
    if isinstance(code, str):
        return code
    if type(exc).__name__ == "OutOfMemoryError":
        return "out_of_memory"
    if isinstance(exc, ValueError):  # a TypeError inside the pipeline is a fault: a 500
        return "invalid_request"
    return "generation_failed"


def describe_request(job: Job) -> str:
    """The request of ``job`` in the user's terms: ``"a 32x32 video of 5 frames, 2 steps"``."""
    spec: JobSpec = job.payload
    params = spec.params
    size = f"{params.width}x{params.height}" if params.width and params.height else "default-size"
    what = f"a {size} video of {params.num_frames} frames" if job.kind == "video" else f"a {size} image"
    steps = params.num_inference_steps
    return what + (f", {steps} step{'s' if steps != 1 else ''}" if steps else "")


def job_error_message(job: Job, exc: BaseException) -> str:
    """A failed job's error for the client: what failed, in the request's terms; the
    exception itself goes only to the server log."""
    if isinstance(exc, RequestRefused):  # checked before generating: the refusal itself
        return exc.message
    what = describe_request(job)
    code = job_error_code(exc)
    if code == "out_of_memory":
        return (f"The device ran out of memory generating {what}; try a smaller size, fewer "
                "frames, or a config that offloads more components.")
    if code == "invalid_request":
        return (f"The model could not generate {what}: it does not accept these values; try "
                "the defaults (omit size, num_frames and num_inference_steps).")
    if code == "replica_failed":
        return (f"The generator replica stopped while generating {what}, and so did the retry "
                f"on another replica; retry later (job {job.id}).")
    return f"The model failed while generating {what}; the server log has the details (job {job.id})."


_FAILURE_STATUS = {
    "invalid_request": 400,
    RequestRefused.error_code: 400,
    "admission_refused": 400,  # engine.admission.AdmissionError, refused where the job runs
    "server_shutdown": 503,
    "cancelled": 503,
    "replica_failed": 503,
}


def job_failure(job: Job) -> APIError:
    """The HTTP error of a failed job: 400 for invalid parameters (with the refused
    field as ``param`` when the job's error names one), 503 when cut short by shutdown,
    cancelled, or lost with its replica (twice), else 500."""
    error = job.error or {"code": "generation_failed", "message": "the job failed"}
    status = _FAILURE_STATUS.get(error["code"], 500)
    headers = {"Retry-After": "5"} if error["code"] == "replica_failed" else None
    return APIError(status, error["message"], code=error["code"], param=error.get("param"),
                    headers=headers)


def submit_error(exc: BaseException) -> APIError:
    """The HTTP error of a refused submission: 429 for :class:`~.jobs.QueueFull`, 503 for
    :class:`~.jobs.ShuttingDown`.

    Raises:
        TypeError: ``exc`` is neither.
    """
    if isinstance(exc, QueueFull):
        return APIError(
            429, f"Too many requests: {exc}.", code="queue_full", headers={"Retry-After": "1"}
        )
    if isinstance(exc, ShuttingDown):
        return APIError(503, "The server is shutting down.", code="shutting_down")
    raise TypeError(f"not a submission error: {exc!r}")


class BaseServerState:
    """What the routes and middleware need: settings, limits, health, jobs, metrics.

    Subclasses set ``engine`` (anything with ``is_video``) once the model is ready, or
    ``load_error``, and implement the job coroutines and ``start``/``stop``.

    Args:
        settings: the server settings.
        metrics: this process's metrics (HTTP requests are counted on them).
    """

    def __init__(self, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.engine: Any = None
        self.rules: Any = None  # models.rules.ModelRules once loaded (None for test doubles)
        self.models: dict[str, ServedModel] = {}  # id -> the served model, once loaded
        self.limits = Limits(
            settings.max_pixels, default_max_frames(settings, None), settings.max_steps,
            settings.size_multiple or 16,
        )
        self.load_error: BaseException | None = None
        self.loaded_at: int = int(time.time())
        self.shutting_down = False
        self.request_shutdown: Callable[[], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start serving (called by the app's lifespan)."""

    def stop(self) -> None:
        """Stop serving (called by the app's lifespan, off the event loop)."""
        self.shutting_down = True

    def require_engine(self) -> Any:
        """The loaded engine.

        Raises:
            APIError: 503 while loading, after a failed load, or while shutting down.
        """
        if self.shutting_down:
            raise APIError(503, "The server is shutting down.", code="shutting_down")
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(
                    503, "The model failed to load; the server log has the details.",
                    code="model_load_failed",
                )
            raise APIError(503, "The model is still loading; retry shortly.", code="model_loading")
        return self.engine

    def served(self, model: str | None, check: bool = True) -> ServedModel:
        """The loaded model a request's ``model`` names (``served.route``): the one model,
        or with several the one named.

        Raises:
            APIError: 503 as ``require_engine``; 400/404 as ``served.route``.
        """
        self.require_engine()
        return self._route(model, check)

    def _route(self, model: str | None, check: bool) -> ServedModel:
        # one model: the state's own engine, limits and rules (the Ray ingress sets its
        # limits from a generator's after loading)
        models = self.models if len(self.models) > 1 else {
            self.settings.model_id: ServedModel(self.settings.model_id, self.engine, self.limits, self.rules)
        }
        return route(models, model, check)

    @property
    def health(self) -> str:
        """``"ok"``, ``"loading"`` or ``"failed"`` (shutting down counts as loading: 503)."""
        if self.load_error is not None:
            return "failed"
        if self.engine is None or self.shutting_down:
            return "loading" if not self.shutting_down else "shutting_down"
        return "ok"

    async def health_report(self, authorized: bool) -> dict[str, Any]:
        """The body of ``GET /health``: ``{"status": ...}``; ``authorized`` (a valid key, or
        no key set) lets subclasses add details (the Ray server lists its replicas)."""
        return {"status": self.health}

    def describe_models(self) -> list[dict[str, Any]]:
        """Per served model, where its weights are now and what it did (``served.describe``)."""
        return describe(self.engine, self.settings.model_id, self.metrics.runs)

    async def render_metrics(self) -> bytes:
        """The Prometheus text exposition of ``GET /metrics``."""
        return self.metrics.render()

    # ------------------------------------------------------------------ jobs

    async def check_request(self, prompt: Any, params: Any, engine: Any = None) -> None:
        """What the engine (and the pipeline's own ``check_inputs``) would refuse, as a 400
        now, run off the event loop; engines without ``check_request`` (test doubles, the
        ingress's description of a remote model) skip it, and their jobs are checked by
        :meth:`ServerState.execute` where the model runs, with the same answer.

        Raises:
            APIError: 400 (:func:`refusal_error`) for the engine's ``ValueError``; any other
                exception propagates (a fault: the generic 500 with a request id, logged).
        """
        check = getattr(engine if engine is not None else self.engine, "check_request", None)
        if check is None:
            return
        try:
            await asyncio.to_thread(check, prompt, params)
        except ValueError as exc:
            raise refusal_error(exc) from None

    async def submit_job(self, job: Job) -> None:
        """Queue a video job (kept until it expires).

        Raises:
            APIError: 429 when the queue or the job store is full, 503 when shutting down.
        """
        raise NotImplementedError

    async def run_and_wait(self, job: Job, disconnected: Callable[[], Any] | None = None) -> Any:
        """Queue ``job``, wait for it, return its result (``ClientGone`` if the client left).

        Raises:
            APIError: a refused submission or the job's failure (:func:`job_failure`).
        """
        raise NotImplementedError

    async def get_job(self, job_id: str) -> Job | None:
        """A kept video job (None when unknown, deleted or expired)."""
        raise NotImplementedError

    async def list_jobs(self) -> list[Job]:
        """Kept video jobs, oldest first."""
        raise NotImplementedError

    async def delete_job(self, job_id: str) -> None:
        """Cancel a queued or running video job (stopped at its next step) or forget a
        finished one.

        Raises:
            KeyError: no such job.
        """
        raise NotImplementedError

    async def job_content(self, job: Job) -> bytes | None:
        """The encoded result of a completed job (None if it expired meanwhile)."""
        raise NotImplementedError

    def response_headers(self, job: Job) -> dict[str, str]:
        """Extra headers of a response carrying ``job``'s result (``X-Replica-Id`` when a
        replica ran it)."""
        return {"X-Replica-Id": job.replica} if job.replica else {}

    # ------------------------------------------------------------------ views

    def video_object(self, job: Job, status: str | None = None) -> dict[str, Any]:
        """OpenAI's video object for ``job`` (plus ``num_frames``, ``fps``, ``seed``).

        ``prompt`` echoes the request's prompt; ``expires_at`` (Unix seconds) is when a
        finished job is dropped (``completed_at + --job-ttl``), None until it finishes.
        """
        spec: JobSpec = job.payload
        params = spec.params
        fps = spec.fps or DEFAULT_FPS
        status = status or job.status
        seconds = spec.seconds
        if seconds is None and params.num_frames is not None:
            seconds = f"{params.num_frames / fps:g}"
        finished = job.completed_at if job.completed_at and status != QUEUED else None
        prompt = spec.prompt["prompt"] if isinstance(spec.prompt, dict) else spec.prompt
        return {
            "id": job.id,
            "object": "video",
            "model": spec.model or self.settings.model_id,
            "status": status,
            "progress": 0 if status == QUEUED else int(job.progress),
            "prompt": prompt,
            "created_at": int(job.created_at),
            "completed_at": None if finished is None else int(finished),
            "expires_at": None if finished is None else int(finished + self.settings.job_ttl),
            "size": spec.size or (f"{params.width}x{params.height}" if params.width and params.height else None),
            "num_frames": params.num_frames,
            "fps": fps,
            "seconds": seconds,
            "seed": params.seed,
            "error": job.error if status == "failed" else None,
        }


class ServerState(BaseServerState):
    """Everything one app serves: settings, engine (loaded in the background), jobs, metrics.

    Args:
        engine: an engine (``generate``, ``is_video``; ``stats``, ``pipeline``, ``close``
            if present) or a factory returning one, called on a background thread at startup.
        settings: the server settings.
    """

    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        if hasattr(engine, "generate"):
            self._factory: Callable[[], Any] | None = None
            self.owns_engine = False
        elif callable(engine):
            self._factory, engine = engine, None
            self.owns_engine = True
        else:
            raise TypeError(f"create_app needs an engine or a factory of one, got {engine!r}")
        self.progress = ProgressTracker()
        self.jobs = JobManager(
            self._run_job,
            settings.max_queue,
            error_code=job_error_code,
            error_message=job_error_message,
            job_ttl=settings.job_ttl,
            max_stored=settings.max_stored_jobs,
            group_of=lambda job: getattr(job.payload, "model", None),
            max_reorder=settings.max_reorder,
        )
        super().__init__(
            settings,
            ServerMetrics(
                engine=lambda: self.engine,
                queue_depth=lambda: self.jobs.queue_depth,
                running=lambda: self.jobs.running_count,
                models=self.describe_models,
                model_ids=settings.model_ids,
            ),
        )
        self.last_activity = time.monotonic()  # the last job's end (idle release)

        def finished(job: Job) -> None:
            self.last_activity = time.monotonic()
            self.metrics.observe_job(job)

        self.jobs.on_finish = finished
        self.idle: IdleRelease | None = None
        self._loader: threading.Thread | None = None
        if engine is not None:
            self._publish(engine)

    # ------------------------------------------------------------------ lifecycle

    def _publish(self, engine: Any) -> None:
        models = {}
        for name, view in engine_views(engine, self.settings.model_id).items():
            limits, rules = model_limits(view, self.settings, default_max_frames)
            self.progress.install(view)
            models[name] = ServedModel(name, view, limits, rules)
        first = next(iter(models.values()))
        self.models, self.limits, self.rules = models, first.limits, first.rules
        listeners = getattr(engine, "listeners", None)
        if isinstance(listeners, list):  # a pool: its swaps on /metrics
            listeners.append(self.metrics.observe_swap)
        self.loaded_at = int(time.time())
        self.engine = engine  # last: requests see a fully prepared engine

    def _load(self) -> None:
        start = time.perf_counter()
        try:
            engine = self._factory()
        except BaseException as exc:  # noqa: BLE001 - reported on /health and by serve()
            self.load_error = exc
            logger.error("diffusion-offload: error: the model failed to load: %s", exc)
            if self.request_shutdown is not None:
                self.request_shutdown()
            return
        self._publish(engine)
        logger.info(
            "model %s loaded in %.1f s", self.settings.model_id, time.perf_counter() - start
        )

    @property
    def loading(self) -> bool:
        """True while the background load is still running."""
        return self._loader is not None and self._loader.is_alive()

    def start(self) -> None:
        """Start the worker, and the background load when built from a factory."""
        self.jobs.start()
        if self._factory is not None and self._loader is None:
            self._loader = threading.Thread(
                target=self._load, name="diffusion-offload-loader", daemon=True
            )
            self._loader.start()
        if self.settings.idle_release is not None and self.idle is None:
            jobs = self.jobs
            self.idle = IdleRelease(self.settings.idle_release, lambda: self.engine,
                                    lambda: jobs.queue_depth > 0 or jobs.running_count > 0,
                                    lambda: self.last_activity)
            self.idle.start()

    def begin_shutdown(self) -> None:
        """Stop accepting work; the running job gets ``shutdown_grace`` seconds."""
        self.shutting_down = True
        self.jobs.begin_shutdown(self.settings.shutdown_grace)

    def stop(self) -> None:
        """Shut down (blocking up to the grace), then close the engine if this state built it."""
        self.shutting_down = True
        if self.idle is not None:
            self.idle.stop()
        idle = self.jobs.shutdown(self.settings.shutdown_grace, settle=SHUTDOWN_SETTLE)
        if self.owns_engine and idle and self.engine is not None and hasattr(self.engine, "close"):
            try:
                self.engine.close()
            except Exception:
                logger.exception("closing the engine failed")

    # ------------------------------------------------------------------ jobs

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            APIError: 429 when the queue is full, 503 when shutting down.
        """
        try:
            self.jobs.submit(job)
        except (QueueFull, ShuttingDown) as exc:
            raise submit_error(exc) from None

    async def submit_job(self, job: Job) -> None:
        """Queue a video job (:meth:`submit`)."""
        self.submit(job)

    async def get_job(self, job_id: str) -> Job | None:
        """A kept job by id (None when unknown, deleted or expired)."""
        return self.jobs.get(job_id)

    async def list_jobs(self) -> list[Job]:
        """Kept jobs, oldest first."""
        return self.jobs.list()

    async def delete_job(self, job_id: str) -> None:
        """:meth:`JobManager.delete` (raises ``KeyError``)."""
        self.jobs.delete(job_id)

    async def job_content(self, job: Job) -> bytes | None:
        """The encoded result of a completed job (mp4 bytes, or a list of PNG bytes)."""
        return job.result

    async def run_and_wait(self, job: Job, disconnected: Callable[[], Any] | None = None) -> Any:
        """Queue ``job``, wait for it without blocking the event loop, return its result.

        ``disconnected`` is an async function that returns once the client has gone; the
        job is then cancelled if it has not started and :class:`ClientGone` is raised.

        Raises:
            APIError: 429/503 from :meth:`submit`; the job's failure (400 for invalid
            parameters, 503 when cut short by shutdown, else 500).
        """
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def wake(_: Job) -> None:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(None))

        job.add_done_callback(wake)
        self.submit(job)
        gone = asyncio.ensure_future(disconnected()) if disconnected is not None else None
        try:
            if gone is None:
                await done
            else:
                await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not done.done():  # the client went away: drop its work if still queued
                    if self.jobs.cancel(job, "the client disconnected before the job started"):
                        logger.info("job %s cancelled: its client disconnected", job.id)
                    raise ClientGone(job.id)
        except asyncio.CancelledError:
            self.jobs.cancel(job)
            raise
        finally:
            if gone is not None and not gone.done():
                gone.cancel()
        if job.status == COMPLETED:
            return job.result
        raise job_failure(job)

    def _run_job(self, job: Job) -> Any:
        return self.execute(job)

    def execute(self, job: Job, on_progress: Callable[[float], None] | None = None) -> Any:
        """Generate ``job`` on the loaded engine and encode it, in the calling thread.

        Args:
            job: an in-progress job whose payload is a :class:`JobSpec`.
            on_progress: also called with the percent done (0-99) after every step.

        Returns:
            A list of encoded images (image jobs: ``spec.image_format``) or the mp4
            bytes (video jobs).

        Raises:
            RequestRefused: the engine's ``check_request`` refused it (checked first, so a
                generator replica refuses what the single-process server refuses on
                arrival, with the same message and field).
            JobAbandoned: the job stopped being in progress (shutdown grace) mid-run.
            Whatever the engine raises.
        """
        from ..engine.media import encode_image, encode_video

        spec: JobSpec = job.payload
        engine = self._route(spec.model, check=False).engine
        outputs = spec.params.num_outputs_per_prompt or 1
        check = getattr(engine, "check_request", None)
        if check is not None:
            try:
                check(spec.prompt, spec.params)
            except ValueError as exc:
                raise RequestRefused.of(exc) from None

        def report(percent: float) -> None:  # called after every denoising step
            if job.status != IN_PROGRESS:  # marked failed by the shutdown grace: stop now
                raise JobAbandoned(f"job {job.id} was abandoned")
            job.progress = percent
            if on_progress is not None:
                on_progress(percent)

        self.progress.begin(outputs, report)
        try:
            result = engine.generate(spec.prompt, spec.params)[0]
        finally:
            self.progress.end()
        self.metrics.observe_peak_memory(getattr(result, "peak_device_memory_bytes", 0) or 0)
        self.metrics.observe_peak_host_memory(getattr(result, "peak_host_memory", None) or {})
        if job.kind == "image":
            return [encode_image(image, spec.image_format, spec.compression)
                    for image in result.images]
        return encode_video(result.frames[0], spec.fps or DEFAULT_FPS, ".mp4")
