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

Importing this package imports Ray; the plain ``serve`` command never does.

Its modules, each importing only those earlier in this list:

- :mod:`.index`: the :class:`JobIndex` actor, its name and namespace, the call timeout,
  heartbeat period and replica labels every replica uses.
- :mod:`.generator`: the :class:`DiffusionGenerator` deployment.
- :mod:`.ingress`: :class:`RayIngressState` and the :class:`DiffusionIngress` deployment.
- :mod:`.deployment`: :func:`build_application`, :func:`deploy`, :func:`undeploy`.
- :mod:`.command`: :func:`serve_ray`, the CLI command.
"""

from __future__ import annotations

from .command import serve_ray
from .deployment import DEVICE_RESOURCE, build_application, deploy, undeploy
from .generator import DiffusionGenerator
from .index import HEARTBEAT_S, JobIndex, ReplicaLost, index_name
from .ingress import DiffusionIngress, RayIngressState

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
