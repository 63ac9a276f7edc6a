"""Issue 12: ``serve --ray``, the same HTTP API scaled out on Ray Serve.

One local Ray cluster for the whole module (``num_cpus=2``, the custom device resource
for 4 generator replicas), Serve's proxy on a free loopback port. Two applications, one
after the other at ``/`` (Serve has one proxy): tiny Flux for images, then tiny Wan2.1 for
videos, each with 2 generator replicas on the fake accelerator and 2 ingress replicas.
Results are compared with the single-process server's for the same seeds.

The first test of each application pays for its deployment (two generator processes
importing torch and diffusers); the ``cluster`` fixture pays for Ray's start (see
BENCHMARKS.md for the module's time). Tests of the CLI flags, the metrics merge and
the lost-replica path of the job index need no cluster; the last one needs Ray installed.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports (CI has no network)

import httpx  # noqa: E402
import pytest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from diffusion_offload.cli import main  # noqa: E402
from diffusion_offload.server import ServerSettings, create_app  # noqa: E402
from diffusion_offload.server.jobs import Job, JobManager  # noqa: E402
from diffusion_offload.server.metrics import (  # noqa: E402
    HTTP_FAMILIES,
    JOB_FAMILIES,
    ServerMetrics,
    merge_snapshots,
)
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

CONFIG = {"mode": "module", "components": ["dit", "text_encoder"]}
API_KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
IMG = "/v1/images/generations"
SLOW = "SLOW"
SLOW_S = 3.0
JOB_TTL = 5.0
NEEDS_RAY = "Ray Serve is not installed: pip install -e '.[ray]'"


# ---------------------------------------------------------------------- helpers


class SlowEngine:
    """An ``Omni`` whose prompts containing ``SLOW`` wait ``SLOW_S`` seconds first (a job
    long enough to kill its replica mid-run); ``EXPLODE`` raises a ``RuntimeError`` and
    ``BADVALUE`` a ``ValueError`` (with a host path in the message)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def generate(self, prompts: Any, params: Any) -> Any:
        text = prompts if isinstance(prompts, str) else prompts["prompt"]
        if SLOW in text:
            time.sleep(SLOW_S)
        if "EXPLODE" in text:
            raise RuntimeError("injected failure reading /home/alice/secret.bin")
        if "BADVALUE" in text:
            raise ValueError("injected: shape [1, 52, -1] invalid in /home/alice/model.py")
        return self.inner.generate(prompts, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_engine(path: str) -> SlowEngine:
    """The engine of every generator replica (and of the single-process reference)."""
    from diffusion_offload.engine import Omni

    return SlowEngine(Omni(path, CONFIG, device="fakegpu", progress=False))


def settings_for(model: Path, **extra: Any) -> ServerSettings:
    """The test servers' settings (those of tests/test_server.py)."""
    return ServerSettings(model_id=str(model), api_key=API_KEY, max_pixels=64 * 64, max_steps=8,
                          max_frames=9, max_body_bytes=65536, max_queue=20, **extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def image_body(seed: int) -> dict:
    return {"prompt": "a red car", "size": "16x16", "num_inference_steps": 1, "seed": seed}


def video_body(prompt: str = "a cat in the city", seed: int = 5) -> dict:
    return {"prompt": prompt, "size": "32x32", "num_frames": 5, "num_inference_steps": 1,
            "guidance_scale": 1.0, "seed": seed}


def fresh(url: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request on a new HTTP connection (a new client each time)."""
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        return client.request(method, path, **kwargs)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def metric(values: dict, name: str, **labels: str) -> float:
    return values.get((name, frozenset(labels.items())), 0.0)


def wait_video(url: str, video_id: str, timeout: float = 90) -> tuple[dict, set[str]]:
    """Poll (a new connection each time) until finished; the final object and the
    ingress replicas that answered."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = fresh(url, "GET", f"/v1/videos/{video_id}")
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-ingress-id"])
        if r.json()["status"] in ("completed", "failed"):
            return r.json(), seen
        time.sleep(0.1)
    raise AssertionError(f"video {video_id} did not finish")


# ---------------------------------------------------------------------- without a cluster


def test_ray_flags_are_checked_before_anything_loads(capsys: pytest.CaptureFixture) -> None:
    cases = {
        ("serve", "m", "--replicas", "2"): "--replicas 2 needs --ray",
        ("serve", "m", "--autoscale", "1:3"): "--autoscale 1:3 needs --ray",
        ("serve", "m", "--ray-address", "auto"): "--ray-address auto needs --ray",
        ("serve", "m", "--ray", "--replicas", "2", "--autoscale", "1:3"):
            "--replicas 2 and --autoscale 1:3 are mutually exclusive",
        ("serve", "m", "--ray", "--autoscale", "3:1"):
            "--autoscale: must be MIN:MAX generator replicas with 1 <= MIN <= MAX, e.g. 1:4, got '3:1'",
        ("serve", "m", "--ray", "--autoscale", "0:2"): "got '0:2'",
        ("serve", "m", "--ray", "--replicas", "0"): "--replicas: must be an integer >= 1, got '0'",
        ("serve", "m", "--ray", "--device", "cuda:1"): "use --device cuda (or omit --device)",
    }
    for argv, expected in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("diffusion-offload: error: ") and expected in err, (argv, err)
        assert err.count("\n") == 1, err


def test_plain_serve_does_not_import_ray() -> None:
    code = ("import sys; import diffusion_offload.cli, diffusion_offload.server.app, "
            "diffusion_offload.server.routes; "
            "from diffusion_offload.cli_args import build_parser; "
            "build_parser().parse_args(['serve', 'm']); "
            "assert sys.modules.get('ray') is None, 'ray imported'; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    # without Ray installed, --ray is one line naming the extra
    code = ("import sys; sys.modules['ray'] = None; from diffusion_offload.cli import main; "
            "sys.exit(main(['serve', 'some/model', '--ray']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith("diffusion-offload: error: --ray needs Ray Serve, which is not "
                                 "installed"), run.stderr
    assert "pip install 'diffusion_offload[ray]'" in run.stderr and run.stderr.count("\n") == 1


def test_merged_metrics_keep_each_replicas_series_under_a_bounded_label() -> None:
    ingress = ServerMetrics(engine=lambda: None, queue_depth=lambda: 0, running=lambda: 0)
    ingress.requests.labels("/health", "GET", "200").inc(3)
    index = ServerMetrics(engine=lambda: None, queue_depth=lambda: 2, running=lambda: 1)
    index.observe_job(Job("image", status="completed", started_at=1.0, completed_at=2.0,
                          created_at=0.5))
    text = merge_snapshots([
        ({}, index.snapshot(JOB_FAMILIES)),
        ({"replica": "ingress-0"}, ingress.snapshot(HTTP_FAMILIES)),
        ({"replica": "ingress-1"}, ingress.snapshot(HTTP_FAMILIES)),
    ]).decode()
    values = samples(text)
    for label in ("ingress-0", "ingress-1"):
        assert metric(values, "diffusion_offload_http_requests_total", endpoint="/health",
                      method="GET", status="200", replica=label) == 3
    assert metric(values, "diffusion_offload_jobs_total", kind="image", status="completed") == 1
    assert metric(values, "diffusion_offload_queue_depth") == 2
    assert metric(values, "diffusion_offload_jobs_running") == 1
    assert "model_loaded" not in text and "_created" not in text  # only the families asked for


def test_job_manager_with_workers_runs_jobs_side_by_side_in_arrival_order() -> None:
    import threading

    started: list[str] = []
    both = threading.Barrier(2, timeout=5)

    def runner(job: Job) -> str:
        started.append(job.payload)
        if job.payload in ("a", "b"):
            both.wait()  # a and b run at the same time, or this times out
        return job.payload

    jobs = JobManager(runner, max_queue=8, workers=2)
    jobs.start()
    submitted = [jobs.submit(Job("video", name, store=True)) for name in "abc"]
    deadline = time.monotonic() + 10
    while not all(j.finished for j in submitted) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [j.status for j in submitted] == ["completed"] * 3
    assert started[2] == "c" and sorted(started[:2]) == ["a", "b"]
    assert jobs.shutdown(1.0)


@pytest.mark.ray
def test_the_ingress_edits_with_the_tables_a_generator_reported() -> None:
    pytest.importorskip("ray", reason=NEEDS_RAY)
    from diffusion_offload.server.ray_serve.generator import _edit_tables
    from diffusion_offload.server.ray_serve.ingress import _RemoteEngine

    class Editor:  # an image model with an image-to-image variant and no inpainting one
        is_video = False

        def knobs_for(self, mask: bool) -> tuple[dict, dict]:
            if mask:
                raise ValueError("TinyPipeline has no inpainting variant in diffusers")
            return {"strength": "knob"}, {"latents": "a tensor"}

    tables = _edit_tables(Editor())
    assert tables == {"image": ({"strength": "knob"}, {"latents": "a tensor"}),
                      "mask": "TinyPipeline has no inpainting variant in diffusers"}
    remote = _RemoteEngine(False, None, "TinyPipeline", tables)
    assert remote.knobs_for(False) == ({"strength": "knob"}, {"latents": "a tensor"})
    with pytest.raises(ValueError, match="no inpainting variant"):
        remote.knobs_for(True)
    with pytest.raises(ValueError, match="TinyPipeline cannot edit images"):
        _RemoteEngine(True, None, "TinyPipeline", None).knobs_for(False)
    video = Editor()
    video.is_video = True
    assert _edit_tables(video) is None and _edit_tables(object()) is None


@pytest.mark.ray
def test_a_job_whose_replica_dies_twice_fails_cleanly_and_is_counted_once() -> None:
    pytest.importorskip("ray", reason=NEEDS_RAY)
    from ray.exceptions import ActorDiedError

    from diffusion_offload.engine.params import SamplingParams
    from diffusion_offload.server.ray_serve import JobIndex
    from diffusion_offload.server.state import JobSpec

    class DyingHandle:  # a generator deployment whose replicas always die mid-job
        calls = 0

        @property
        def run(self) -> Any:
            return self

        def remote(self, job: Job, attempt: int) -> Any:
            DyingHandle.calls += 1
            return self

        def result(self) -> Any:
            raise ActorDiedError()

    index = JobIndex(ServerSettings(model_id="m"), "app", workers=1)
    index._handle = DyingHandle()
    spec = JobSpec("a cat", SamplingParams(width=32, height=32, num_frames=5, num_inference_steps=2))
    job = Job("video", spec, store=True)
    assert index.submit(job) is None
    deadline = time.monotonic() + 10
    while not job.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert DyingHandle.calls == 2  # the first attempt and one retry
    assert job.status == "failed" and job.error["code"] == "replica_failed"
    assert job.error["message"].startswith(
        "The generator replica stopped while generating a 32x32 video of 5 frames, 2 steps, "
        "and so did the retry on another replica")
    assert [a.get("lost") for a in index.job_attempts(job.id)] == [True, True]
    values = samples(merge_snapshots(index.metric_parts()).decode())
    assert metric(values, "diffusion_offload_jobs_total", kind="video", status="failed") == 1
    assert index.get(job.id).error == job.error
    index.jobs.shutdown(0.1)


@pytest.mark.ray
def test_deployments_take_one_device_each_and_autoscale_on_ongoing_jobs() -> None:
    pytest.importorskip("ray.serve", reason=NEEDS_RAY)
    from diffusion_offload.server.ray_serve import DEVICE_RESOURCE, build_application

    settings = ServerSettings(model_id="m", max_queue=40)

    def deployments(**kwargs: Any) -> tuple[Any, Any]:
        ingress = build_application("m", settings, **kwargs)._bound_deployment
        return ingress, ingress.init_args[2]._bound_deployment

    ingress, generator = deployments(autoscale=(2, 5), ingress_replicas=3)
    scaling = generator._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (2, 5, 1)
    assert generator.max_ongoing_requests == 1  # one job at a time per replica; Serve queues
    assert generator.ray_actor_options == {"num_cpus": 0, "resources": {DEVICE_RESOURCE: 1}}
    assert ingress.num_replicas == 3 and ingress.max_ongoing_requests == 160
    assert ingress.ray_actor_options == {"num_cpus": 0}

    _, generator = deployments(replicas=4, use_gpus=True)
    assert generator.num_replicas == 4 and generator._deployment_config.autoscaling_config is None
    assert generator.ray_actor_options == {"num_cpus": 0, "num_gpus": 1}
    with pytest.raises(ValueError, match="1 <= min <= max"):
        deployments(autoscale=(3, 2))


# ---------------------------------------------------------------------- the cluster


class Cluster:
    """The module's Ray cluster and Serve proxy; deploys one application at a time."""

    def __init__(self, root: Path) -> None:
        import ray
        from ray import serve
        from ray.cloudpickle import register_pickle_by_value

        from diffusion_offload.server import ray_serve

        self.ray, self.serve, self.rs = ray, serve, ray_serve
        register_pickle_by_value(sys.modules[__name__])  # SlowEngine/make_engine to replicas
        self.models = {kind: tiny_pipelines.save(kind, root / kind)
                       for kind in ("flux", "wan2.1", "wan2.2-i2v")}
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR", resources={ray_serve.DEVICE_RESOURCE: 4},
                 object_store_memory=200 * 2**20)
        self.port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        self.url = f"http://127.0.0.1:{self.port}"
        self.kind: str | None = None
        self.index: Any = None

    def use(self, kind: str, **settings: Any) -> Any:
        """Deploy the application of ``kind`` (2 generators, 2 ingress replicas) at ``/``,
        replacing the previous one; returns its job index actor."""
        if self.kind == kind:
            return self.index
        started = time.monotonic()
        if self.kind is not None:
            self.rs.undeploy(self.kind, grace=1.0)
        model = self.models[kind]
        app_settings = settings_for(model, **settings)
        application = self.rs.build_application(
            str(model), app_settings, app_name=kind, replicas=2, ingress_replicas=2,
            engine_factory=functools.partial(make_engine, str(model)),
        )
        self.index = self.rs.deploy(application, app_settings, app_name=kind, workers=2)
        self.kind = kind
        deadline = time.monotonic() + 60
        while True:  # ingress replicas learn the model from the generators' first heartbeat
            r = httpx.get(f"{self.url}/health", headers=AUTH, timeout=10)
            live = {rep["id"] for rep in r.json().get("replicas", [])}
            wanted = {"generator-0", "generator-1", "ingress-0", "ingress-1"}
            if r.status_code == 200 and wanted <= live:
                print(f"\n{kind} application deployed in {time.monotonic() - started:.1f} s")
                return self.index
            assert time.monotonic() < deadline, r.text
            time.sleep(0.2)

    def close(self) -> None:
        try:
            self.serve.shutdown()
        finally:
            self.ray.shutdown()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One local Ray cluster for the module (started once, shut down at the end)."""
    pytest.importorskip("ray", reason=NEEDS_RAY)
    pytest.importorskip("ray.serve", reason=NEEDS_RAY)
    started = time.monotonic()
    running = Cluster(tmp_path_factory.mktemp("ray-models"))
    print(f"\nray cluster and serve started in {time.monotonic() - started:.1f} s")
    yield running
    started = time.monotonic()
    running.close()
    print(f"\nray cluster shut down in {time.monotonic() - started:.1f} s")


@pytest.fixture(scope="module")
def reference(cluster: Cluster) -> dict[str, Any]:
    """The single-process server's results: PNGs for seeds 200..207, the mp4s of
    ``video_body()`` and ``video_body(SLOW ...)``."""
    from fastapi.testclient import TestClient

    out: dict[str, Any] = {}
    for kind in ("flux", "wan2.1"):
        model = cluster.models[kind]
        engine = make_engine(str(model))
        app = create_app(engine.inner, settings_for(model))
        with TestClient(app, base_url="http://127.0.0.1", headers=AUTH) as client:
            if kind == "flux":
                for seed in range(200, 208):
                    r = client.post(IMG, json=image_body(seed))
                    assert r.status_code == 200, r.text
                    out[seed] = base64.b64decode(r.json()["data"][0]["b64_json"])
            else:
                for name, body in (("video", video_body()),
                                   ("slow", video_body(f"{SLOW} cat", seed=9))):
                    job = client.post("/v1/videos", json=body).json()
                    deadline = time.monotonic() + 60
                    while client.get(f"/v1/videos/{job['id']}").json()["status"] != "completed":
                        assert time.monotonic() < deadline
                        time.sleep(0.05)
                    out[name] = client.get(f"/v1/videos/{job['id']}/content").content
        engine.inner.close()
    return out


@pytest.fixture()
def images(cluster: Cluster) -> Cluster:
    cluster.use("flux")
    return cluster


@pytest.fixture()
def videos(cluster: Cluster) -> Cluster:
    cluster.use("wan2.1", job_ttl=JOB_TTL)
    return cluster


# ---------------------------------------------------------------------- images


@pytest.mark.ray
def test_eight_concurrent_images_on_two_replicas_equal_the_single_process_results(
    images: Cluster, reference: dict[str, Any]
) -> None:
    async def batch() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=images.url, headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(c.post(IMG, json=image_body(s)) for s in range(200, 208)))

    before = samples(fresh(images.url, "GET", "/metrics").text)
    responses = asyncio.run(batch())
    served_by = []
    for seed, r in zip(range(200, 208), responses, strict=True):
        assert r.status_code == 200, r.text
        png = base64.b64decode(r.json()["data"][0]["b64_json"])
        assert png == reference[seed], f"seed {seed}: differs from the single-process server"
        served_by.append(r.headers["x-replica-id"])
    assert set(served_by) == {"generator-0", "generator-1"}, served_by  # both replicas served
    assert len({reference[s] for s in range(200, 208)}) == 8

    deadline = time.monotonic() + 15  # generators' metrics arrive with their heartbeats
    while True:
        after = samples(fresh(images.url, "GET", "/metrics").text)
        done = (metric(after, "diffusion_offload_jobs_total", kind="image", status="completed")
                - metric(before, "diffusion_offload_jobs_total", kind="image", status="completed"))
        loads = {
            label: metric(after, "diffusion_offload_weight_loads_total", replica=label)
            - metric(before, "diffusion_offload_weight_loads_total", replica=label)
            for label in ("generator-0", "generator-1")
        }
        if done == 8 and all(loads.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert done == 8  # counted once each, cluster-wide
    assert all(v > 0 for v in loads.values()), loads  # each replica moved weights
    for label in ("generator-0", "generator-1"):
        assert metric(after, "diffusion_offload_model_loaded", replica=label) == 1
    assert metric(after, "diffusion_offload_replicas", role="generator") == 2
    assert metric(after, "diffusion_offload_replicas", role="ingress") == 2


@pytest.mark.ray
def test_health_lists_replicas_only_to_a_caller_with_the_key_and_labels_stay_bounded(
    images: Cluster,
) -> None:
    assert httpx.get(f"{images.url}/health").json() == {"status": "ok"}
    wrong = httpx.get(f"{images.url}/health", headers={"Authorization": "Bearer nope"})
    assert wrong.json() == {"status": "ok"}
    body = httpx.get(f"{images.url}/health", headers=AUTH).json()
    assert body["status"] == "ok"
    roles = {rep["id"]: rep["role"] for rep in body["replicas"]}
    assert roles == {"generator-0": "generator", "generator-1": "generator",
                     "ingress-0": "ingress", "ingress-1": "ingress"}
    # hostile paths and methods add no series; replica labels are the 4 ranks only
    for i in range(30):
        fresh(images.url, "GET" if i % 2 else "PATCH", f"/x{i}/{'y' * i}")
    text = fresh(images.url, "GET", "/metrics").text
    labels = {dict(k[1]).get("replica") for k in samples(text)} - {None}
    assert labels == {"generator-0", "generator-1", "ingress-0", "ingress-1"}
    # every live replica is listed, also an ingress that has answered nothing yet
    ages = {dict(k[1])["replica"]: (dict(k[1])["role"], v) for k, v in samples(text).items()
            if k[0] == "diffusion_offload_replica_heartbeat_age_seconds"}
    assert {label: role for label, (role, _) in ages.items()} == roles
    assert all(0 <= age < 10 for _, age in ages.values()), ages  # index.STALE_S
    endpoints = {dict(k[1]).get("endpoint") for k in samples(text)} - {None}
    assert endpoints <= {"/health", "/metrics", IMG, "other", "/v1/models"}, endpoints


@pytest.mark.ray
def test_errors_limits_and_auth_answer_as_the_single_process_server(images: Cluster) -> None:
    from fastapi.testclient import TestClient

    requests = [
        ("POST", IMG, {"json": {"prompt": "x", "size": "4096x4096"}}, AUTH),
        ("POST", IMG, {"json": {"prompt": "x", "num_inference_steps": 99}}, AUTH),
        ("POST", IMG, {"json": {"prompt": "x", "model": "other"}}, AUTH),
        ("POST", IMG, {"json": {"prompt": "x", "size": "17x16"}}, AUTH),
        ("POST", IMG, {"json": {"prompt": "x", "n": 0}}, AUTH),
        ("POST", IMG, {"content": b"{" + b" " * 70000 + b"}",
                       "headers": {"content-type": "application/json"}}, AUTH),
        ("POST", IMG, {"json": {"prompt": "x"}}, {}),
        ("GET", "/v1/models", {}, {"Authorization": "Bearer wrong"}),
        ("POST", "/v1/videos", {"json": {"prompt": "x"}}, AUTH),
        ("GET", "/v1/videos/video_nope", {}, AUTH),
        ("DELETE", "/v1/videos/video_nope", {}, AUTH),
        ("GET", "/v1/videos?limit=0", {}, AUTH),
        ("GET", "/nowhere", {}, AUTH),
    ]
    model = images.models["flux"]
    engine = make_engine(str(model)).inner
    try:
        with TestClient(create_app(engine, settings_for(model)), base_url="http://127.0.0.1") as single:
            for method, path, kwargs, headers in requests:
                extra = kwargs.pop("headers", {})
                with httpx.Client(base_url=images.url, timeout=60) as client:
                    ours = client.request(method, path, headers={**headers, **extra}, **kwargs)
                theirs = single.request(method, path, headers={**headers, **extra}, **kwargs)
                assert ours.status_code == theirs.status_code, (path, ours.text, theirs.text)
                assert ours.json() == theirs.json(), (path, ours.text, theirs.text)
                assert ours.status_code >= 400
    finally:
        engine.close()


@pytest.mark.ray
def test_a_failing_generation_answers_as_in_one_process_and_leaks_no_detail(images: Cluster) -> None:
    r = fresh(images.url, "POST", IMG, json={**image_body(1), "prompt": "EXPLODE car"})
    assert r.status_code == 500, r.text
    assert "alice" not in r.text and "Error" not in r.text  # details go to the replica log
    err = r.json()["error"]
    assert err["code"] == "generation_failed" and err["type"] == "server_error"
    assert err["message"].startswith("The model failed while generating a 16x16 image, 1 step; "
                                     "the server log has the details (job image_")
    r = fresh(images.url, "POST", IMG, json={**image_body(1), "prompt": "BADVALUE car"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"
    assert r.json()["error"]["message"].startswith("The model could not generate a 16x16 image")
    assert "alice" not in r.text and "Error" not in r.text
    assert fresh(images.url, "POST", IMG, json=image_body(2)).status_code == 200


@pytest.mark.ray
def test_a_queued_image_whose_client_leaves_is_cancelled_and_never_runs(images: Cluster) -> None:
    import threading

    def jobs(status: str) -> float:
        values = samples(fresh(images.url, "GET", "/metrics").text)
        return metric(values, "diffusion_offload_jobs_total", kind="image", status=status)

    before = {status: jobs(status) for status in ("completed", "cancelled")}
    slow = {**image_body(300), "prompt": f"{SLOW} car"}
    holders = [threading.Thread(target=fresh, args=(images.url, "POST", IMG), kwargs={"json": slow})
               for _ in range(2)]
    for holder in holders:
        holder.start()
    deadline = time.monotonic() + 10
    while True:  # both generators busy: the next job waits in the index's queue
        values = samples(fresh(images.url, "GET", "/metrics").text)
        if metric(values, "diffusion_offload_jobs_running") == 2:
            break
        assert time.monotonic() < deadline, "the slow jobs never ran"
        time.sleep(0.05)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{images.url}{IMG}", json=image_body(301), headers=AUTH, timeout=1.0)
    for holder in holders:
        holder.join(30)
    deadline = time.monotonic() + 10
    while jobs("cancelled") - before["cancelled"] < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert jobs("cancelled") - before["cancelled"] == 1
    assert jobs("completed") - before["completed"] == 2  # the abandoned one never ran
    values = samples(fresh(images.url, "GET", "/metrics").text)
    assert metric(values, "diffusion_offload_queue_depth") == 0


@pytest.mark.ray
def test_edits_on_ray_equal_the_single_process_edits(images: Cluster) -> None:
    """``/v1/images/edits`` (image-to-image, and with a mask inpainting) through the
    ingress replicas: the generators' variants make the single-process server's bytes."""
    import io

    import numpy as np
    from fastapi.testclient import TestClient
    from PIL import Image

    picture = Image.fromarray((np.arange(16 * 16 * 3).reshape(16, 16, 3) * 7 % 251).astype("uint8"))
    mask = Image.new("L", (16, 16), 0)
    mask.paste(255, (4, 4, 12, 12))

    def png(image: Image.Image) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()

    data = {"prompt": "a red car", "seed": "3", "num_inference_steps": "1", "strength": "0.9"}
    uploads = [{"image": ("in.png", png(picture), "image/png")},
               {"image": ("in.png", png(picture), "image/png"),
                "mask": ("mask.png", png(mask), "image/png")}]
    got = []
    for files in uploads:
        r = fresh(images.url, "POST", "/v1/images/edits", data=data, files=files)
        assert r.status_code == 200, r.text
        got.append(r.json()["data"][0]["b64_json"])
    model = images.models["flux"]
    engine = make_engine(str(model))
    try:
        with TestClient(create_app(engine.inner, settings_for(model)), base_url="http://127.0.0.1",
                        headers=AUTH) as client:
            want = [client.post("/v1/images/edits", data=data, files=files).json()["data"][0]["b64_json"]
                    for files in uploads]
    finally:
        engine.inner.close()
    assert got == want and got[0] != got[1]


# ---------------------------------------------------------------------- videos


@pytest.mark.ray
def test_video_job_lives_across_ingress_replicas_and_connections(
    videos: Cluster, reference: dict[str, Any]
) -> None:
    created = fresh(videos.url, "POST", "/v1/videos", json=video_body())
    assert created.status_code == 200, created.text
    video_id, creator = created.json()["id"], created.headers["x-ingress-id"]
    assert created.json()["status"] == "queued"
    final, pollers = wait_video(videos.url, video_id)
    assert final["status"] == "completed" and final["progress"] == 100
    for _ in range(60):  # make sure another ingress replica has answered for this job
        if pollers - {creator}:
            break
        r = fresh(videos.url, "GET", f"/v1/videos/{video_id}")
        assert r.json()["status"] == "completed"
        pollers.add(r.headers["x-ingress-id"])
    assert pollers - {creator}, (creator, pollers)

    content = fresh(videos.url, "GET", f"/v1/videos/{video_id}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    assert content.content == reference["video"]  # the single-process server's bytes
    assert content.headers["x-replica-id"] in ("generator-0", "generator-1")
    listed = fresh(videos.url, "GET", "/v1/videos").json()
    assert [j["id"] for j in listed["data"]] == [video_id]

    deleted = fresh(videos.url, "DELETE", f"/v1/videos/{video_id}")
    assert deleted.json() == {"id": video_id, "object": "video.deleted", "deleted": True}
    gone_on: set[str] = set()
    for _ in range(60):  # gone on both ingress replicas
        r = fresh(videos.url, "GET", f"/v1/videos/{video_id}")
        assert r.status_code == 404, r.text
        gone_on.add(r.headers["x-ingress-id"])
        if gone_on == {"ingress-0", "ingress-1"}:
            break
    assert gone_on == {"ingress-0", "ingress-1"}


@pytest.mark.ray
def test_finished_video_jobs_expire_after_the_ttl(videos: Cluster) -> None:
    video_id = fresh(videos.url, "POST", "/v1/videos", json=video_body(seed=6)).json()["id"]
    final, _ = wait_video(videos.url, video_id)
    assert final["status"] == "completed"
    assert fresh(videos.url, "GET", f"/v1/videos/{video_id}/content").status_code == 200
    time.sleep(JOB_TTL + 0.5)
    for _ in range(4):
        assert fresh(videos.url, "GET", f"/v1/videos/{video_id}").status_code == 404
        assert fresh(videos.url, "GET", f"/v1/videos/{video_id}/content").status_code == 404
    assert fresh(videos.url, "GET", "/v1/videos").json()["data"] == []


@pytest.mark.ray
def test_killed_generator_replica_mid_job_the_job_completes_once_on_the_other(
    videos: Cluster, reference: dict[str, Any]
) -> None:
    ray = videos.ray
    index = videos.index
    before = samples(fresh(videos.url, "GET", "/metrics").text)
    video_id = fresh(videos.url, "POST", "/v1/videos",
                     json=video_body(f"{SLOW} cat", seed=9)).json()["id"]
    deadline = time.monotonic() + 30
    while not (attempts := ray.get(index.job_attempts.remote(video_id))):
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)
    victim = attempts[0]["actor"]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)  # mid-job (SLOW)

    final, _ = wait_video(videos.url, video_id)
    assert final["status"] == "completed", final
    attempts = ray.get(index.job_attempts.remote(video_id))
    assert [a["attempt"] for a in attempts] == [1, 1, 2], attempts
    assert attempts[1].get("lost") and attempts[2]["actor"] != victim
    content = fresh(videos.url, "GET", f"/v1/videos/{video_id}/content")
    assert content.content == reference["slow"]

    # later requests succeed (on the survivor while Serve replaces the dead replica)
    later = [fresh(videos.url, "POST", "/v1/videos", json=video_body(seed=s)).json()["id"]
             for s in (11, 12)]
    assert [wait_video(videos.url, v)[0]["status"] for v in later] == ["completed"] * 2
    after = samples(fresh(videos.url, "GET", "/metrics").text)
    for status, count in (("completed", 3), ("failed", 0)):  # the killed job counted once
        delta = (metric(after, "diffusion_offload_jobs_total", kind="video", status=status)
                 - metric(before, "diffusion_offload_jobs_total", kind="video", status=status))
        assert delta == count, status


# ---------------------------------------------------------------------- image-to-video


@pytest.mark.ray
def test_input_reference_on_ray_equals_the_single_process_video(cluster: Cluster) -> None:
    """Tiny Wan2.2 I2V: ``input_reference`` through the ingress replicas (which learn from
    the generators that the model needs an image) makes the single-process server's mp4."""
    import io

    from fastapi.testclient import TestClient

    cluster.use("wan2.2-i2v")
    buf = io.BytesIO()
    tiny_pipelines.default_call_kwargs("wan2.2-i2v")["image"].save(buf, format="PNG")
    data = {"prompt": "a cat", "size": "32x32", "num_frames": "5", "num_inference_steps": "2",
            "seed": "4"}
    files = {"input_reference": ("ref.png", buf.getvalue(), "image/png")}
    r = fresh(cluster.url, "POST", "/v1/videos", data=data, files=files)
    assert r.status_code == 200, r.text
    final, _ = wait_video(cluster.url, r.json()["id"])
    assert final["status"] == "completed", final
    got = fresh(cluster.url, "GET", f"/v1/videos/{final['id']}/content").content
    missing = fresh(cluster.url, "POST", "/v1/videos", data=data)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input_reference"
    assert "WanImageToVideoPipeline makes videos from an image" in missing.json()["error"]["message"]
    model = cluster.models["wan2.2-i2v"]
    engine = make_engine(str(model))
    try:
        with TestClient(create_app(engine.inner, settings_for(model)), base_url="http://127.0.0.1",
                        headers=AUTH) as client:
            job = client.post("/v1/videos", data=data, files=files).json()
            deadline = time.monotonic() + 60
            while client.get(f"/v1/videos/{job['id']}").json()["status"] != "completed":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            want = client.get(f"/v1/videos/{job['id']}/content").content
    finally:
        engine.inner.close()
    assert got == want
