"""Prometheus metrics of the server, on their own ``CollectorRegistry``.

Exposed at ``GET /metrics`` (text format):

- ``diffusion_offload_http_requests_total{endpoint,method,status}`` and
  ``diffusion_offload_http_request_duration_seconds{endpoint,method}`` (histogram); the
  endpoint is the route template (``/v1/videos/{video_id}``), ``other`` for unknown paths;
  the method is one of the standard ones or ``other``, so label sets stay bounded whatever
  clients send.
- ``diffusion_offload_jobs_total{kind,status}`` (status ``completed``, ``failed``,
  ``cancelled``), ``diffusion_offload_job_queue_seconds{kind}`` and
  ``diffusion_offload_job_run_seconds{kind}`` (histograms).
- ``diffusion_offload_queue_depth`` (jobs waiting), ``diffusion_offload_jobs_running``,
  ``diffusion_offload_model_loaded``.
- ``diffusion_offload_weight_h2d_bytes_total``, ``..._weight_d2h_bytes_total``,
  ``..._weight_loads_total``, ``..._weight_evictions_total``,
  ``..._weight_transfer_seconds_total``: the engine's own cumulative ``TransferStats``,
  read at scrape time (so they equal ``Omni.stats``).
- ``diffusion_offload_peak_device_memory_bytes``: the highest per-request peak device
  memory seen; ``diffusion_offload_last_peak_device_memory_bytes``: the latest request's.
- ``diffusion_offload_peak_host_memory_bytes{kind}`` and
  ``diffusion_offload_last_peak_host_memory_bytes{kind}``: the same for the sampled peak
  resident host memory of a request (``kind`` ``anon``: RssAnon, ``file``: RssFile;
  ``engine.hostrss``), 0 off Linux.
- ``diffusion_offload_model_swaps_total{model}``, ``diffusion_offload_model_swap_seconds{model}``
  (histogram: the seconds to hand the device to a model of a pool: the awake one's sleep
  and its wake) and ``diffusion_offload_model_bytes{model,tier}`` (``tier``: ``device``,
  ``pinned``, ``pageable``, ``disk``; read at scrape time). One label per served model:
  the ids are fixed at start, so the label sets are bounded.
- ``diffusion_offload_pinned_host_bytes`` and ``..._pinned_overhead_bytes``: the engine's
  pinned host memory now, every byte (``TransferStats.pinned_total_bytes``), and the part that is
  not host copies (staging ring, check buffers, rounding); read at scrape time.

Several processes (the Ray Serve replicas) each take a :meth:`ServerMetrics.snapshot` of
their own families; :func:`merge_snapshots` renders them as one exposition, adding each
part's labels (``replica="generator-0"``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import Match

__all__ = [
    "CONTENT_TYPE_LATEST", "ENGINE_FAMILIES", "HTTP_FAMILIES", "JOB_FAMILIES", "MetricsMiddleware",
    "ServerMetrics", "Snapshot", "merge_snapshots",
]

_PREFIX = "diffusion_offload"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_STATUSES = frozenset(range(100, 600))
_HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_JOB_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)
_STATS = (
    ("h2d_bytes", "weight_h2d_bytes", "Weight bytes the engine copied host -> device."),
    ("d2h_bytes", "weight_d2h_bytes", "Weight bytes the engine copied device -> host."),
    ("loads", "weight_loads", "Component loads that moved weights to the device."),
    ("evictions", "weight_evictions", "Component evictions that moved weights off the device."),
    ("transfer_seconds", "weight_transfer_seconds", "Seconds spent in weight loads and evictions."),
    ("disk_read_bytes", "disk_read_bytes", "Bytes loads read from disk-backed host copies."),
    ("disk_read_seconds", "disk_read_seconds", "Seconds loads spent reading disk-backed host copies."),
)
_STAT_GAUGES = (
    ("pinned_total_bytes", "pinned_host_bytes", "Pinned host memory the engine holds now, every byte."),
    ("pinned_overhead_bytes", "pinned_overhead_bytes",
     "Of it, what is not host copies: staging ring, write-check buffers, padding, rounding."),
)
_HOST_KINDS = {"anon": "rss_anon_bytes", "file": "rss_file_bytes"}


HTTP_FAMILIES = frozenset(f"{_PREFIX}_{n}" for n in ("http_requests", "http_request_duration_seconds"))
"""Families counted where HTTP requests are answered."""
JOB_FAMILIES = frozenset(
    f"{_PREFIX}_{n}" for n in ("jobs", "job_queue_seconds", "job_run_seconds", "queue_depth", "jobs_running")
)
"""Families counted where jobs are queued and finished."""
ENGINE_FAMILIES = frozenset(
    [f"{_PREFIX}_{n}" for n in ("model_loaded", "peak_device_memory_bytes",
                                "last_peak_device_memory_bytes", "peak_host_memory_bytes",
                                "last_peak_host_memory_bytes", "model_bytes", "model_swaps",
                                "model_swap_seconds")]
    + [f"{_PREFIX}_{name}" for _, name, _ in _STATS + _STAT_GAUGES]
)
"""Families of the engine (one per generator)."""

Snapshot = list[tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]]
"""Metric families as plain data: ``(name, documentation, type, unit, samples)``, each
sample ``(sample name, labels, value)``."""


class _Families:
    """A registry stand-in for ``generate_latest``: yields prepared families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_snapshots(parts: Iterable[tuple[dict[str, str], Snapshot]]) -> bytes:
    """One Prometheus text exposition of several snapshots.

    Args:
        parts: ``(labels, snapshot)`` pairs; ``labels`` (e.g. ``{"replica": "generator-0"}``,
            or ``{}``) are added to every sample of that snapshot. Families of the same
            name are merged (the first part's documentation and type win).

    Returns:
        The exposition (``CONTENT_TYPE_LATEST``).
    """
    families: dict[str, Metric] = {}
    for labels, snap in parts:
        for name, doc, kind, unit, samples in snap:
            family = families.get(name)
            if family is None:
                family = families[name] = Metric(name, doc, kind, unit)
            for sample_name, sample_labels, value in samples:
                family.add_sample(sample_name, {**sample_labels, **labels}, value)
    return generate_latest(_Families(list(families.values())))


class _EngineStatsCollector(Collector):
    """The engine's cumulative ``TransferStats`` as counters, and its host-memory gauges,
    read at scrape time."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self._engine = engine

    def describe(self) -> list:
        return []

    def collect(self):
        engine = self._engine()
        stats = getattr(engine, "stats", None) if engine is not None else None
        for attr, name, doc in _STATS:
            value = getattr(stats, attr, 0) if stats is not None else 0
            yield CounterMetricFamily(f"{_PREFIX}_{name}", doc, value=float(value))
        for attr, name, doc in _STAT_GAUGES:
            value = getattr(stats, attr, 0) if stats is not None else 0
            yield GaugeMetricFamily(f"{_PREFIX}_{name}", doc, value=float(value))


class _ModelBytesCollector(Collector):
    """``diffusion_offload_model_bytes{model,tier}`` from the served models' descriptions,
    read at scrape time."""

    _TIERS = (("device", "device_bytes"), ("pinned", "pinned_bytes"), ("pageable", "pageable_bytes"),
              ("disk", "disk_bytes"))

    def __init__(self, models: Callable[[], list[dict[str, Any]]]) -> None:
        self._models = models

    def describe(self) -> list:
        return []

    def collect(self):
        family = GaugeMetricFamily(f"{_PREFIX}_model_bytes", "Weight bytes of each served model by tier now.",
                                   labels=["model", "tier"])
        for m in self._models():
            for tier, key in self._TIERS:
                family.add_metric([m["id"], tier], float(m.get(key, 0)))
        yield family


class ServerMetrics:
    """The server's metrics.

    Args:
        engine: returns the loaded engine or None (read at scrape time).
        queue_depth: returns the number of waiting jobs.
        running: returns the number of running jobs (0 or 1).
        models: returns the served models' descriptions (``describe_models``: ``id``,
            ``device_bytes``, ``pinned_bytes``...), read at scrape time.
        model_ids: every served model's id (their swap series are exported from the start).

    Attributes:
        runs: jobs that started running (a finished job's ``started_at`` set).
    """

    def __init__(
        self,
        engine: Callable[[], Any],
        queue_depth: Callable[[], int],
        running: Callable[[], int],
        models: Callable[[], list[dict[str, Any]]] = lambda: [],
        model_ids: tuple[str, ...] = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{_PREFIX}_http_requests",
            "HTTP requests by endpoint, method and status.",
            ["endpoint", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            f"{_PREFIX}_http_request_duration_seconds",
            "HTTP request latency by endpoint.",
            ["endpoint", "method"],
            buckets=_HTTP_BUCKETS,
            registry=r,
        )
        self.jobs = Counter(
            f"{_PREFIX}_jobs", "Finished jobs by kind and status.", ["kind", "status"], registry=r
        )
        self.queue_seconds = Histogram(
            f"{_PREFIX}_job_queue_seconds",
            "Seconds jobs waited in the queue.",
            ["kind"],
            buckets=_JOB_BUCKETS,
            registry=r,
        )
        self.run_seconds = Histogram(
            f"{_PREFIX}_job_run_seconds",
            "Seconds jobs ran (generation and encoding).",
            ["kind"],
            buckets=_JOB_BUCKETS,
            registry=r,
        )
        Gauge(f"{_PREFIX}_queue_depth", "Jobs waiting to run.", registry=r).set_function(
            queue_depth
        )
        Gauge(f"{_PREFIX}_jobs_running", "Jobs running (0 or 1).", registry=r).set_function(running)
        Gauge(f"{_PREFIX}_model_loaded", "1 once the model is loaded.", registry=r).set_function(
            lambda: 0.0 if engine() is None else 1.0
        )
        self.peak_memory = Gauge(
            f"{_PREFIX}_peak_device_memory_bytes",
            "Highest per-request peak device memory seen.",
            registry=r,
        )
        self.last_peak_memory = Gauge(
            f"{_PREFIX}_last_peak_device_memory_bytes",
            "Peak device memory of the latest request.",
            registry=r,
        )
        self._peak = 0
        self.peak_host = Gauge(
            f"{_PREFIX}_peak_host_memory_bytes",
            "Highest per-request sampled peak resident host memory seen (anon: RssAnon, file: RssFile).",
            ["kind"],
            registry=r,
        )
        self.last_peak_host = Gauge(
            f"{_PREFIX}_last_peak_host_memory_bytes",
            "Sampled peak resident host memory of the latest request (anon: RssAnon, file: RssFile).",
            ["kind"],
            registry=r,
        )
        self._peak_host = dict.fromkeys(_HOST_KINDS, 0)
        for kind in _HOST_KINDS:  # export zeros before the first job
            self.peak_host.labels(kind)
            self.last_peak_host.labels(kind)
        r.register(_EngineStatsCollector(engine))
        r.register(_ModelBytesCollector(models))
        self.swaps = Counter(f"{_PREFIX}_model_swaps", "Times the device was handed to a model.", ["model"],
                             registry=r)
        self.swap_seconds = Histogram(f"{_PREFIX}_model_swap_seconds",
                                      "Seconds to hand the device to a model (sleep the awake one, wake it).",
                                      ["model"], buckets=_HTTP_BUCKETS, registry=r)
        for model in model_ids:
            self.swaps.labels(model)
            self.swap_seconds.labels(model)
        self.runs = 0
        for kind in ("image", "video"):  # export zeros before the first job
            for status in ("completed", "failed", "cancelled"):
                self.jobs.labels(kind, status)

    def observe_peak_memory(self, nbytes: int) -> None:
        """Record one request's peak device memory."""
        nbytes = int(nbytes)
        self.last_peak_memory.set(nbytes)
        if nbytes > self._peak:
            self._peak = nbytes
            self.peak_memory.set(nbytes)

    def observe_peak_host_memory(self, peaks: dict[str, int]) -> None:
        """Record one request's sampled peak host memory (``GenerationOutput.peak_host_memory``:
        ``rss_anon_bytes``, ``rss_file_bytes``; a field it lacks counts 0)."""
        for kind, key in _HOST_KINDS.items():
            nbytes = int(peaks.get(key, 0))
            self.last_peak_host.labels(kind).set(nbytes)
            if nbytes > self._peak_host[kind]:
                self._peak_host[kind] = nbytes
                self.peak_host.labels(kind).set(nbytes)

    def observe_swap(self, model: str, seconds: float) -> None:
        """Count a swap to ``model`` that took ``seconds`` (a ``ModelPool`` listener)."""
        self.swaps.labels(model).inc()
        self.swap_seconds.labels(model).observe(seconds)

    def observe_job(self, job: Any) -> None:
        """Count a finished job and its queue and run times."""
        code = (job.error or {}).get("code")
        status = "cancelled" if code == "cancelled" else job.status
        self.jobs.labels(job.kind, status).inc()
        if job.started_at is not None:
            self.runs += 1
            self.queue_seconds.labels(job.kind).observe(max(0.0, job.started_at - job.created_at))
            if job.completed_at is not None:
                self.run_seconds.labels(job.kind).observe(
                    max(0.0, job.completed_at - job.started_at)
                )

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)

    def snapshot(self, names: Iterable[str] | None = None) -> Snapshot:
        """The current values as plain (picklable) data, for :func:`merge_snapshots`.

        Args:
            names: only these families (e.g. :data:`HTTP_FAMILIES`); None: all of them.
                ``*_created`` samples are left out.
        """
        wanted = None if names is None else frozenset(names)
        out: Snapshot = []
        for family in self.registry.collect():
            if wanted is not None and family.name not in wanted:
                continue
            samples = [
                (sample.name, dict(sample.labels), float(sample.value))
                for sample in family.samples
                if not sample.name.endswith("_created")
            ]
            out.append((family.name, family.documentation, family.type, family.unit, samples))
        return out


class MetricsMiddleware:
    """ASGI middleware counting every HTTP request and its latency (outermost layer)."""

    def __init__(self, app: Any, metrics: ServerMetrics, routes: Callable[[], list]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def _endpoint(self, scope: dict) -> str:
        """The route path for the metrics label: a full match, else the first route whose
        path matches with another method, else ``"other"``."""
        partial = None
        for route in self.routes():
            try:
                match, _ = route.matches(scope)
            except Exception:
                continue
            if match == Match.FULL:
                return getattr(route, "path", "other")
            if match == Match.PARTIAL and partial is None:
                partial = getattr(route, "path", "other")
        return partial or "other"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Run the app, recording the status it answered and the time it took."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            endpoint = self._endpoint(scope)
            method = scope.get("method", "GET")
            method = method if method in _METHODS else "other"  # label values stay bounded
            code = status["code"] if status["code"] in _STATUSES else 500
            self.metrics.requests.labels(endpoint, method, str(code)).inc()
            self.metrics.latency.labels(endpoint, method).observe(time.perf_counter() - start)
