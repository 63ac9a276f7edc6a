"""Building and deploying the ``serve --ray`` application on a running Ray cluster.

:func:`build_application` binds the ingress to the generator deployment (replica counts,
autoscaling, GPU or :data:`DEVICE_RESOURCE`); :func:`deploy` starts the job index and
runs the application on Serve; :func:`undeploy` shuts both down, giving running jobs a
grace period.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray
from ray import serve

from ..state import ServerSettings
from .generator import DiffusionGenerator
from .index import CALL_TIMEOUT_S, GENERATOR, NAMESPACE, JobIndex, index_name
from .ingress import DiffusionIngress

__all__ = ["DEVICE_RESOURCE", "INGRESS", "QUIET_SERVE_LOGS", "build_application", "deploy", "undeploy"]

logger = logging.getLogger("diffusion_offload.server")

DEVICE_RESOURCE = "diffusion_offload_device"
"""Custom Ray resource a generator replica takes (1) when it does not take a GPU."""
INGRESS = "DiffusionIngress"
QUIET_SERVE_LOGS: dict[str, Any] = {"log_level": "WARNING", "enable_access_log": False}
"""Ray Serve's ``logging_config`` for our deployments and its proxy and controller: no
INFO line per request (its access log) or per replica event; warnings and errors stay."""


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
        app_name: the Serve application name (the job index is :func:`~.index.index_name` of it).
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
        "logging_config": QUIET_SERVE_LOGS,
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
        logging_config=QUIET_SERVE_LOGS,
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
