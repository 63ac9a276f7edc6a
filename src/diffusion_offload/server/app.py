"""The HTTP server: ``create_app`` (FastAPI) and ``serve`` (``diffusion-offload serve``).

Endpoints (OpenAI's shapes; every error is ``{"error": {"message", "type", "param", "code"}}``):

- ``GET /health``: 200 once the model is loaded, 503 before (and while shutting down);
  never needs the API key (under Ray Serve, a caller with a valid key, or anyone when
  no key is set, also gets the list of replicas).
- ``GET /v1/models``, ``GET /v1/models/{id}``: the one model, its id as given on the
  command line.
- ``POST /v1/images/generations`` (JSON): ``{created, data: [{b64_json, url: null,
  revised_prompt: null}]}`` (PNG, or ``output_format`` jpeg/webp), with
  ``response_format="url"`` ``data: [{url}]``, served by ``GET
  /v1/images/{id}/{index}.{format}`` (kept like a video job: ``--job-ttl``,
  ``--max-stored-jobs``), with ``"file"`` the image bytes.
- ``POST /v1/images/edits`` (multipart: ``image``, optional ``mask``): the same answer, by
  the model's image-to-image or inpainting variant (:mod:`.uploads` checks the files).
- ``POST /v1/chat/completions`` (JSON): images as ``image_url`` parts (:mod:`.chat`).
- ``POST /v1/videos`` (JSON, multipart or url-encoded form) -> a queued video job; ``GET /v1/videos``,
  ``GET /v1/videos/{id}``, ``GET /v1/videos/{id}/content`` (the mp4; 409 until
  completed), ``DELETE /v1/videos/{id}`` (cancel queued or running, the latter at its next
  step; delete finished).
- ``GET /metrics``: Prometheus text format (see :mod:`.metrics`).

Requests from other web pages are refused with 403 (foreign ``Origin``,
``Sec-Fetch-Site: cross-site``, or, on loopback, a foreign ``Host``; see :mod:`.middleware`).
With an API key, every ``/v1/`` route needs ``Authorization: Bearer KEY`` (401 otherwise);
``/health`` and ``/metrics`` do not. Request bodies over ``max_body_bytes`` answer 413
(by ``Content-Length`` and by the bytes actually received). Every generation, image
requests included, runs on one worker thread, one at a time (:mod:`.jobs`); a full queue
answers 429. Finished video jobs are kept for ``--job-ttl`` seconds, at most
``--max-stored-jobs`` of them (oldest finished dropped first); an expired id answers 404.
An omitted field takes the server's default (the model's) and limits apply to the
resolved values. A 5xx carries a generic message and a request id; details are logged.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI

from .metrics import MetricsMiddleware
from .middleware import GuardMiddleware, InternalErrorMiddleware
from .routes import add_routes
from .connections import ConnectionLimits, protocol_class, resolve_max_connections
from .state import SHUTDOWN_SETTLE, BaseServerState, ServerSettings, ServerState

__all__ = ["ServerSettings", "ServerState", "build_app", "create_app", "serve"]

logger = logging.getLogger("diffusion_offload.server")


def create_app(engine: Any, settings: ServerSettings) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
        engine: a loaded engine (used as is, not closed on shutdown) or a zero-argument
            factory returning one (called on a background thread at startup, so
            ``/health`` answers 503 until it returns; closed on shutdown).
        settings: limits, API key, queue size, shutdown grace.

    Returns:
        The app; ``app.state.server`` is its :class:`ServerState`.
    """
    return build_app(ServerState(engine, settings))


def build_app(state: BaseServerState) -> FastAPI:
    """The FastAPI app over ``state``: the routes, error envelopes, guards and metrics.

    ``state.start()`` runs at startup and ``state.stop()`` (off the event loop) at shutdown.
    :func:`create_app` builds it over a local engine; the Ray Serve ingress
    (:mod:`.ray_serve`) over its shared job index.
    """
    settings = state.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.stop)

    app = FastAPI(title="diffusion-offload", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    add_routes(app, state)
    app.add_middleware(InternalErrorMiddleware)
    if settings.allowed_origins:  # CORS answers (and preflights) for the allowed origins only
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(GuardMiddleware, state=state)
    app.add_middleware(MetricsMiddleware, metrics=state.metrics, routes=lambda: app.routes)
    return app


# ---------------------------------------------------------------------- CLI


def fail(message: str) -> int:
    """Print ``diffusion-offload: error: MESSAGE`` to stderr; returns 2, the exit status."""
    print(f"diffusion-offload: error: {message}", file=sys.stderr)
    return 2


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port``.

    Raises:
        ValueError: the address cannot be used (in use, not an address of this machine,
            no permission); one line naming ``--host``/``--port``.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} is not an address or a known host name ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ValueError(
                f"--port {port}: address {host}:{port} is already in use (another server?); "
                "choose another --port, or --port 0 for a free one"
            ) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise ValueError(
                f"--port {port}: no permission to bind {host}:{port} (ports below 1024 need "
                "privileges); choose a port from 1024 to 65535"
            ) from None
        raise ValueError(f"--host {host!r} --port {port}: cannot bind ({exc.strerror or exc})") from None
    sock.set_inheritable(True)
    return sock


def serve(args: argparse.Namespace) -> int:
    """Run ``diffusion-offload serve``; returns the exit status.

    Settings, offload config, dtype, device and model files (``--variant``, truncated or
    corrupt safetensors) are validated and the address is bound first: a bad one prints
    one line ``diffusion-offload: error: ...`` and returns 2, loading nothing. Then
    the model loads in the background; once listening, one line
    ``serving MODEL at http://HOST:PORT`` goes to stdout. Connections are bounded and slow
    clients cut off (:mod:`.connections`). SIGINT/SIGTERM stop new work, let the running
    job finish for up to ``--shutdown-grace`` seconds, then mark it failed and exit within
    :data:`~.state.SHUTDOWN_SETTLE` more seconds; a second signal marks it failed and exits
    at once (status 130). Temporary files live in a private folder removed on exit. A model that fails to load in the
    background stops the server: status 2 when it is a user error (fit check, model
    files, bad value), else 1. A generation still running after the grace ends the
    process with ``os._exit`` once everything is answered and cleaned up (exiting the
    interpreter under native code would abort it).
    """
    from ..cli_args import CliError, check_lora_args, parse_config_args, quiet_libraries

    from .model_list import model_specs

    try:
        config = parse_config_args(args)
        check_lora_args(args)
        defaults = {"config": None if config == "auto" else config, "variant": getattr(args, "variant", None),
                    "dtype": args.dtype, "loras": [tuple(lora) for lora in getattr(args, "lora", None) or []]}
        specs = model_specs(args.model, getattr(args, "extra_models", []), getattr(args, "models_file", None),
                            defaults)
        settings = ServerSettings.from_args(args, tuple(s.id for s in specs))
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be from 0 to 65535, got {args.port}")
        limits = ConnectionLimits(
            max_connections=resolve_max_connections(settings.max_connections),
            timeout_keep_alive=settings.timeout_keep_alive,
            timeout_headers=settings.timeout_headers,
            timeout_body=settings.timeout_body,
        )
    except (CliError, ValueError) as exc:
        return fail(str(exc))

    quiet_libraries()
    from ..engine import FitError, ModelError
    from ..models.files import inspect_model, resolve_model
    from ..engine.omni import parse_dtype, pick_device
    from ..engine.omni import build_omni

    pooled = len(specs) > 1 or getattr(args, "models_file", None) is not None
    try:
        dtype = parse_dtype(args.dtype)
        device = pick_device(args.device)
    except (ValueError, TypeError) as exc:
        return fail(str(exc))
    for spec in specs:
        try:
            parse_dtype(spec.dtype)
            inspect_model(resolve_model(spec.path), spec.variant)
        except (ModelError, ValueError, TypeError) as exc:
            return fail(f"model {spec.id!r}: {exc}" if pooled else str(exc))
    model_dir = resolve_model(specs[0].path)
    try:
        sock = bind_socket(args.host, args.port)
    except ValueError as exc:
        return fail(str(exc))
    variant = getattr(args, "variant", None)
    pinned = getattr(args, "max_pinned_memory", None)
    budget = getattr(args, "device_memory_budget", None)
    extra: dict[str, Any] = {} if budget is None else {"device_memory_budget": budget}
    host_budget = getattr(args, "host_memory_budget", None)
    if host_budget is not None:
        extra["host_memory_budget"] = host_budget
    if getattr(args, "page_cache", None) is not None:
        extra["page_cache"] = args.page_cache
    if getattr(args, "lora", None):
        extra["loras"] = [tuple(lora) for lora in args.lora]

    def factory() -> Any:
        if pooled:  # several models take turns on the device (engine.pool)
            from ..engine.pool import ModelPool

            shared = {k: v for k, v in extra.items() if k not in ("loras", "host_memory_budget")}
            return ModelPool(specs, host_memory_budget=extra.get("host_memory_budget"), device=device,
                             max_pinned_bytes=pinned, progress=False, **shared)
        if settings.idle_release is not None and config is not None:
            extra["sleepable"] = True  # idle release empties the device of the one model too
        return build_omni(model_dir, config, variant=variant, max_pinned_bytes=pinned, device=device,
                          dtype=dtype, progress=False, name=settings.model_id, **extra)

    tmp = tempfile.mkdtemp(prefix="diffusion-offload-serve-")
    previous_tmp = tempfile.tempdir
    tempfile.tempdir = tmp  # ffmpeg's and our temporary files: removed below, whatever happens
    try:
        app = create_app(factory, settings)
        state: ServerState = app.state.server
        server = _Server(
            uvicorn.Config(
                app,
                host=args.host,
                port=sock.getsockname()[1],
                lifespan="on",
                log_level="info",
                http=protocol_class(limits),
                timeout_keep_alive=limits.timeout_keep_alive,  # type: ignore[arg-type]
                # requests waiting on the running job are answered when the grace ends
                timeout_graceful_shutdown=settings.shutdown_grace + SHUTDOWN_SETTLE,  # type: ignore[arg-type]
            ),
            state,
            url=f"http://{_url_host(args.host)}:{sock.getsockname()[1]}",
            on_force_exit=lambda: shutil.rmtree(tmp, ignore_errors=True),
        )

        def stop_serving() -> None:
            server.should_exit = True

        state.request_shutdown = stop_serving
        try:
            server.run(sockets=[sock])
        except SystemExit as exc:  # uvicorn exits when it cannot serve
            code = exc.code if isinstance(exc.code, int) else 1
            return code or 1
        finally:
            sock.close()
        status = 0
        if state.load_error is not None:
            error = state.load_error
            user_error = (FitError, ModelError, ValueError, TypeError, NotImplementedError, OSError)
            status = 2 if isinstance(error, user_error) else 1
        stuck = not state.jobs.join(timeout=0.0) or state.loading
    finally:
        tempfile.tempdir = previous_tmp
        shutil.rmtree(tmp, ignore_errors=True)
    if stuck:
        # A generation (or the model load) is still inside native code: ending the interpreter
        # under it would abort the process. Everything is answered and cleaned up; exit now.
        logger.warning("a generation or the model load is still running; exiting without waiting")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _url_host(host: str) -> str:
    """``host`` as written in a URL (IPv6 addresses in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class _Server(uvicorn.Server):
    """uvicorn's server, printing its address once listening, with SIGINT/SIGTERM starting
    the graceful shutdown.

    The first signal stops new work at once (503) and starts the running job's grace
    period; uvicorn then closes the listener and waits for open requests, and the app's
    lifespan waits for the worker. Unlike uvicorn's default, the signal is not re-raised
    afterwards, so ``serve`` returns 0. A second SIGINT or SIGTERM marks the running job
    failed, calls ``on_force_exit`` (cleanup) and ends the process at once (status 130).
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, url: str,
                 on_force_exit: Any = None) -> None:
        super().__init__(config)
        self._state = state
        self._url = url
        self._on_force_exit = on_force_exit

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, then one line ``serving MODEL at http://HOST:PORT`` on stdout."""
        await super().startup(sockets=sockets)
        if self.started:
            print(f"serving {', '.join(self._state.settings.model_ids)} at {self._url}", flush=True)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """Begin the graceful shutdown, or on a second signal exit now (signal handler)."""
        name = signal.Signals(sig).name
        if self.should_exit:
            self._exit_now(name)
            return
        self._state.shutting_down = True
        grace = self._state.settings.shutdown_grace
        running = self._state.jobs.running
        if running is not None:
            logger.info(
                "received %s: job %s may finish for up to %g s (--shutdown-grace), then it is "
                "marked failed and the server exits within %g s; %s again exits now",
                name, running.id, grace, grace + SHUTDOWN_SETTLE, name,
            )
        else:
            logger.info("received %s: no job running; exiting", name)
        threading.Thread(
            target=self._state.begin_shutdown, name="diffusion-offload-shutdown", daemon=True
        ).start()
        self.should_exit = True

    def _exit_now(self, name: str) -> None:
        for job in self._state.jobs.abandon_running(f"the server was stopped by a second {name}"):
            logger.error("job %s marked failed: the server was stopped by a second %s", job.id, name)
        logger.warning("received %s again: exiting now", name)
        if self._on_force_exit is not None:
            self._on_force_exit()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
