"""The ``diffusion-offload serve MODEL --ray`` command: :func:`serve_ray`.

Validates like the plain ``serve``, starts or joins a Ray cluster, plans the generators'
devices (GPUs, or the :data:`~.deployment.DEVICE_RESOURCE` resource), deploys the
application and serves until a signal, then shuts everything down within bounded time.
"""

from __future__ import annotations

import argparse
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

from ..app import bind_socket, fail
from ..state import ServerSettings
from .deployment import DEVICE_RESOURCE, QUIET_SERVE_LOGS, build_application, deploy, undeploy
from .index import CALL_TIMEOUT_S

__all__ = ["serve_ray"]

logger = logging.getLogger("diffusion_offload.server")


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
    from ...cli_args import CliError, parse_config_args, quiet_libraries

    try:
        settings = ServerSettings.from_args(args)
        config = parse_config_args(args)
    except (CliError, ValueError) as exc:
        return fail(str(exc))
    quiet_libraries()
    from pathlib import Path

    from ...engine import ModelError
    from ...models.files import inspect_model, resolve_model
    from ...engine.omni import parse_dtype

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
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # no INFO line per app event
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
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=QUIET_SERVE_LOGS)
        engine_options = {"device": "cuda" if use_gpus else args.device, "dtype": args.dtype,
                          "variant": getattr(args, "variant", None),
                          "max_pinned_bytes": getattr(args, "max_pinned_memory", None)}
        budget = getattr(args, "device_memory_budget", None)
        if budget is not None:  # as plain serve: each replica applies it to its own device
            engine_options["device_memory_budget"] = budget
        if getattr(args, "lora", None):
            engine_options["loras"] = list(args.lora)
        app_name = "diffusion-offload"
        application = build_application(
            model, settings, app_name=app_name,
            # "auto" stays "auto": each replica plans for its own device
            config=config.to_dict() if hasattr(config, "to_dict") else config,
            engine_options=engine_options, replicas=args.replicas or 1, autoscale=autoscale,
            ingress_replicas=args.ingress_replicas or 1, use_gpus=use_gpus,
        )
        # a list, not a threading.Event: the handler runs on the main thread, which may be
        # inside Event.wait holding its lock (Event.set there would deadlock)
        signals: list[int] = []

        def on_signal(signum: int, _frame: Any) -> None:
            signals.append(signum)
            if len(signals) > 1:
                raise KeyboardInterrupt  # a second one: stop waiting for running jobs

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                index = deploy(application, settings, app_name=app_name, workers=wanted)
            except RuntimeError as exc:
                undeploy(app_name, grace=0)
                message = " ".join(str(exc).split())
                return fail(f"the application failed to deploy: {message[:2000]}")
            picked = (ray.get(index.model.remote(), timeout=CALL_TIMEOUT_S) or {}).get("plan")
            if picked:  # the line plain serve logs for "auto"
                print(picked, file=sys.stderr, flush=True)
            count = f"{autoscale[0]}-{autoscale[1]} (autoscaled)" if autoscale else str(args.replicas)
            print(f"diffusion-offload: serving {args.model} at http://{args.host}:{args.port} on Ray "
                  f"Serve: {count} generator replica(s), {args.ingress_replicas or 1} ingress "
                  "replica(s); Ctrl-C to stop", file=sys.stderr, flush=True)
            try:
                while not signals:
                    time.sleep(0.2)
                print(f"diffusion-offload: stopping (running jobs get up to {settings.shutdown_grace:g} s; "
                      "Ctrl-C again to stop now)", file=sys.stderr, flush=True)
                _bounded(lambda: undeploy(app_name, grace=settings.shutdown_grace),
                         settings.shutdown_grace + 15.0, "undeploy")
            except KeyboardInterrupt:
                print("diffusion-offload: stopping now (running jobs are cut off)", file=sys.stderr, flush=True)
                if not local:  # a cluster that outlives us: take the application down
                    _bounded(lambda: undeploy(app_name, grace=0), 15.0, "undeploy")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        # a local cluster goes with ray.shutdown below, Serve's controller included (its
        # serve.shutdown would race the kill: "graceful_shutdown failed" on a clean exit)
        return 0
    finally:
        if not _bounded(ray.shutdown, 15.0, "ray-shutdown"):
            logging.shutdown()
            sys.stderr.flush()
            os._exit(1)
