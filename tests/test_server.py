"""``diffusion-offload serve`` against real uvicorn servers on loopback (issue 5 "Must show").

Two servers run in threads for the whole module, each over a tiny random pipeline on the
fake accelerator with ``{"mode": "module", "components": ["dit", "text_encoder"]}``:
Flux for images and Wan2.1 for videos. Their engines are wrapped so that a prompt
containing ``EXPLODE`` raises inside the transformer's forward (a pipeline failure with
offloaded weights on the device). Subprocess tests cover the CLI: a bad config exits 2
with one line, and SIGTERM shuts down gracefully leaving no temporary files.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import imageio.v3 as iio  # noqa: E402
import pytest  # noqa: E402
import uvicorn  # noqa: E402
from PIL import Image  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from diffusion_offload.engine import GenerationOutput, Omni  # noqa: E402
from diffusion_offload.server import ServerSettings, create_app  # noqa: E402
from diffusion_offload.server.jobs import Job, JobManager  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

CONFIG = {"mode": "module", "components": ["dit", "text_encoder"]}
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TRIGGER = "EXPLODE"
HOLD = "HOLD"
MAX_BODY = 65536
IMG = "/v1/images/generations"


# ---------------------------------------------------------------------- helpers


class FlakyEngine:
    """An ``Omni`` wrapper for failure injection and holding jobs.

    A prompt containing ``EXPLODE`` makes the transformer raise mid-pipeline; one
    containing ``HOLD`` waits for ``release`` before generating.
    """

    def __init__(self, inner: Omni) -> None:
        self.inner = inner
        self.release = threading.Event()

    def generate(self, prompts: Any, params: Any) -> list[GenerationOutput]:
        """``Omni.generate``, failing inside the DiT's forward for the trigger prompt."""
        text = prompts if isinstance(prompts, str) else prompts["prompt"]
        if HOLD in text:
            assert self.release.wait(60), "test never released the held job"
        handle = None
        if TRIGGER in text:

            def boom(module: Any, args: Any) -> None:
                raise RuntimeError("injected failure in the transformer")

            handle = self.inner.pipeline.transformer.register_forward_pre_hook(boom)
        try:
            return self.inner.generate(prompts, params)
        finally:
            if handle is not None:
                handle.remove()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Running:
    """A uvicorn server running ``app`` in a thread on 127.0.0.1."""

    server: uvicorn.Server
    thread: threading.Thread
    url: str
    app: Any

    @property
    def state(self) -> Any:
        """The app's ``ServerState``."""
        return self.app.state.server

    def client(self, **kwargs: Any) -> httpx.Client:
        """An httpx client with the API key."""
        return httpx.Client(base_url=self.url, headers=AUTH, timeout=120, **kwargs)

    def stop(self) -> None:
        """Graceful stop; waits for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


def start_server(engine: Any, settings: ServerSettings, wait_healthy: bool = True) -> Running:
    """Serve ``create_app(engine, settings)`` on an ephemeral loopback port."""
    app = create_app(engine, settings)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    running = Running(server, thread, f"http://127.0.0.1:{port}", app)
    if wait_healthy:
        wait_health(running.url)
    return running


def wait_health(url: str, timeout: float = 120, proc: subprocess.Popen | None = None) -> None:
    """Poll ``/health`` until 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became healthy")


def wait_video(
    client: httpx.Client, video_id: str, timeout: float = 120
) -> tuple[dict, list[dict]]:
    """Poll a video job until it finishes; returns the final object and all polled ones."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = client.get(f"/v1/videos/{video_id}")
        assert r.status_code == 200, r.text
        seen.append(r.json())
        if seen[-1]["status"] in ("completed", "failed"):
            return seen[-1], seen
        time.sleep(0.05)
    raise AssertionError(f"video {video_id} did not finish: {seen[-1]}")


def wait_status(client: httpx.Client, video_id: str, status: str, timeout: float = 60) -> None:
    """Poll until the job has ``status``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.get(f"/v1/videos/{video_id}").json()["status"] == status:
            return
        time.sleep(0.02)
    raise AssertionError(f"video {video_id} never reached {status}")


def decode_png(b64: str) -> tuple[bytes, Image.Image]:
    """PNG bytes and the decoded image."""
    data = base64.b64decode(b64)
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.format == "PNG"
    return data, image


def image_body(seed: int, size: str = "16x16", **extra: Any) -> dict:
    """A cheap image request (1 step)."""
    return {"prompt": "a red car", "size": size, "num_inference_steps": 1, "seed": seed, **extra}


def video_body(**extra: Any) -> dict:
    """A cheap video request (1 step, no CFG)."""
    return {
        "prompt": "a cat in the city",
        "size": "32x32",
        "num_frames": 5,
        "num_inference_steps": 1,
        "guidance_scale": 1.0,
        "seed": 5,
        **extra,
    }


def scrape(client: httpx.Client) -> dict[tuple[str, frozenset], float]:
    """``/metrics`` as ``{(sample name, labels): value}``."""
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def free_port() -> int:
    """A currently free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli() -> list[str]:
    """The ``diffusion-offload`` command."""
    exe = shutil.which("diffusion-offload")
    return [exe] if exe else [sys.executable, "-m", "diffusion_offload.cli"]


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny Flux and Wan2.1 pipelines in diffusers format."""
    root = tmp_path_factory.mktemp("models")
    return {kind: tiny_pipelines.save(kind, root / kind) for kind in ("flux", "wan2.1")}


def _settings(model: Path, **kwargs: Any) -> ServerSettings:
    return ServerSettings(
        model_id=str(model),
        api_key=API_KEY,
        max_pixels=64 * 64,
        max_steps=8,
        max_frames=9,
        max_body_bytes=MAX_BODY,
        **kwargs,
    )


@pytest.fixture(scope="module")
def image_server(model_dirs: dict[str, Path]) -> Iterator[Running]:
    """The Flux server (engine loaded in the background by a factory)."""
    path = model_dirs["flux"]
    running = start_server(
        lambda: FlakyEngine(Omni(str(path), CONFIG, device="fakegpu", progress=False)),
        _settings(path, max_queue=20),
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def video_server(model_dirs: dict[str, Path]) -> Iterator[Running]:
    """The Wan2.1 server, with room for only 2 waiting jobs."""
    path = model_dirs["wan2.1"]
    running = start_server(
        lambda: FlakyEngine(Omni(str(path), CONFIG, device="fakegpu", progress=False)),
        _settings(path, max_queue=2, shutdown_grace=10),
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def alone(image_server: Running) -> dict[int, bytes]:
    """PNG bytes of ``image_body(seed)`` for seeds 100..115, each request sent alone."""
    out = {}
    with image_server.client() as c:
        for seed in range(100, 116):
            r = c.post(IMG, json=image_body(seed))
            assert r.status_code == 200, r.text
            (item,) = r.json()["data"]
            out[seed], image = decode_png(item["b64_json"])
            assert image.size == (16, 16)
    return out


# ---------------------------------------------------------------------- images


def test_health_models_and_auth(image_server: Running) -> None:
    with image_server.client() as c:
        assert httpx.get(f"{image_server.url}/health").json()["status"] == "ok"  # no key needed
        models = c.get("/v1/models").json()
        assert models["object"] == "list"
        assert [m["id"] for m in models["data"]] == [image_server.state.settings.model_id]
        assert c.get(f"/v1/models/{image_server.state.settings.model_id}").status_code == 200
        assert httpx.get(f"{image_server.url}/v1/models").status_code == 401
        assert httpx.get(f"{image_server.url}/metrics").status_code == 200  # no key needed


def test_images_sizes_n_and_seed_offsets(image_server: Running, alone: dict[int, bytes]) -> None:
    with image_server.client() as c:
        r = c.post(IMG, json=image_body(100, n=2, user="someone", response_format="b64_json"))
        assert r.status_code == 200, r.text
        body = r.json()
        assert isinstance(body["created"], int)
        assert [decode_png(d["b64_json"])[0] for d in body["data"]] == [
            alone[100],
            alone[101],
        ]  # seed + i

        r = c.post(IMG, json=image_body(7, size="32x16"))
        assert r.status_code == 200, r.text
        _, image = decode_png(r.json()["data"][0]["b64_json"])
        assert image.size == (32, 16)
        assert image.mode == "RGB"


def test_sixteen_concurrent_requests_equal_requests_sent_alone(
    image_server: Running, alone: dict[int, bytes]
) -> None:
    async def batch() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=image_server.url, headers=AUTH, timeout=300) as c:
            return await asyncio.gather(
                *(c.post(IMG, json=image_body(seed)) for seed in range(100, 116))
            )

    before = scrape(image_server.client())
    responses = asyncio.run(batch())
    after = scrape(image_server.client())
    for seed, r in zip(range(100, 116), responses, strict=True):
        assert r.status_code == 200, r.text
        data, _ = decode_png(r.json()["data"][0]["b64_json"])
        assert data == alone[seed], (
            f"seed {seed}: concurrent result differs from the request sent alone"
        )
    assert len(set(alone.values())) == 16  # distinct seeds, distinct images
    done = metric(after, "diffusion_offload_jobs_total", kind="image", status="completed") - metric(
        before, "diffusion_offload_jobs_total", kind="image", status="completed"
    )
    assert done == 16
    # they really were queued together: some waited for others
    waits = metric(after, "diffusion_offload_job_queue_seconds_sum", kind="image") - metric(
        before, "diffusion_offload_job_queue_seconds_sum", kind="image"
    )
    assert waits > 1.0


def test_image_failure_is_reported_and_the_server_keeps_serving(image_server: Running) -> None:
    with image_server.client() as c:
        r = c.post(IMG, json=image_body(1, prompt=f"a {TRIGGER} car"))
        assert r.status_code == 500
        err = r.json()["error"]
        # the user's terms, not the exception text (which goes to the server log only)
        assert err["message"].startswith("The model failed while generating a 16x16 image, 1 step;")
        assert "injected" not in err["message"] and "RuntimeError" not in err["message"]
        assert err["type"] == "server_error" and err["code"] == "generation_failed"
        assert c.get("/health").status_code == 200
        r = c.post(IMG, json=image_body(100))
        assert r.status_code == 200, r.text


def test_metrics_match_engine_statistics(image_server: Running) -> None:
    engine = image_server.state.engine
    with image_server.client() as c:
        before = scrape(c)
        stats_before = engine.stats.snapshot()
        assert c.post(IMG, json=image_body(3)).status_code == 200
        assert c.post(IMG, json=image_body(4, n=2)).status_code == 200
        assert c.post(IMG, json={"prompt": "x", "n": 0}).status_code == 400
        assert c.post(IMG, json=image_body(5, prompt=TRIGGER)).status_code == 500
        assert httpx.post(f"{image_server.url}{IMG}", json=image_body(6)).status_code == 401
        after = scrape(c)
    stats = engine.stats

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    req = "diffusion_offload_http_requests_total"
    for status, count in (("200", 2), ("400", 1), ("500", 1), ("401", 1)):
        assert delta(req, endpoint=IMG, method="POST", status=status) == count, status
    assert (
        delta("diffusion_offload_http_request_duration_seconds_count", endpoint=IMG, method="POST")
        == 5
    )
    assert delta("diffusion_offload_jobs_total", kind="image", status="completed") == 2
    assert delta("diffusion_offload_jobs_total", kind="image", status="failed") == 1
    assert delta("diffusion_offload_job_run_seconds_count", kind="image") == 3

    # the weight counters are the engine's own, exactly
    for name, value in (
        ("diffusion_offload_weight_h2d_bytes_total", stats.h2d_bytes),
        ("diffusion_offload_weight_d2h_bytes_total", stats.d2h_bytes),
        ("diffusion_offload_weight_loads_total", stats.loads),
        ("diffusion_offload_weight_evictions_total", stats.evictions),
        ("diffusion_offload_disk_read_bytes_total", stats.disk_read_bytes),
        ("diffusion_offload_pinned_host_bytes", stats.pinned_total_bytes),
        ("diffusion_offload_pinned_overhead_bytes", stats.pinned_overhead_bytes),
    ):
        assert metric(after, name) == value, name
    assert stats.pinned_bytes > 0 and stats.pinned_overhead_bytes > 0  # host copies and check buffers
    moved = stats.since(stats_before)
    assert delta("diffusion_offload_weight_h2d_bytes_total") == moved.h2d_bytes > 0
    assert delta("diffusion_offload_weight_loads_total") == moved.loads > 0
    assert delta("diffusion_offload_weight_evictions_total") == moved.evictions > 0
    assert metric(after, "diffusion_offload_weight_transfer_seconds_total") == pytest.approx(
        stats.transfer_seconds
    )

    peak = metric(after, "diffusion_offload_peak_device_memory_bytes")
    assert peak >= metric(after, "diffusion_offload_last_peak_device_memory_bytes") > 0
    for kind in ("anon", "file"):  # the sampled RssAnon / RssFile peaks of the requests (Linux)
        last = metric(after, "diffusion_offload_last_peak_host_memory_bytes", kind=kind)
        assert metric(after, "diffusion_offload_peak_host_memory_bytes", kind=kind) >= last > 0
    assert metric(after, "diffusion_offload_queue_depth") == 0
    assert metric(after, "diffusion_offload_jobs_running") == 0
    assert metric(after, "diffusion_offload_model_loaded") == 1


# ---------------------------------------------------------------------- videos


def test_video_job_roundtrip_json_and_multipart_same_bytes(video_server: Running) -> None:
    body = video_body(size="48x32", fps=8, seed=11, num_inference_steps=2)
    with video_server.client() as c:
        r = c.post("/v1/videos", json=body)
        assert r.status_code == 200, r.text
        created = r.json()
        assert created["status"] == "queued" and isinstance(created["created_at"], int)
        assert created["id"].startswith("video_")
        final, seen = wait_video(c, created["id"])
        assert final["status"] == "completed", final
        assert final["progress"] == 100 and final["error"] is None
        progress = [s["progress"] for s in seen]
        assert progress == sorted(progress)
        r = c.get(f"/v1/videos/{created['id']}/content")
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
        frames = iio.imread(r.content, extension=".mp4")
        assert frames.shape == (5, 32, 48, 3)  # 5 frames of 48x32
        meta = iio.immeta(r.content, extension=".mp4")
        assert meta["fps"] == pytest.approx(8)

        form = {k: (None, str(v)) for k, v in body.items()}  # multipart, same request
        r2 = c.post("/v1/videos", files=form)
        assert r2.status_code == 200, r2.text
        final2, _ = wait_video(c, r2.json()["id"])
        assert final2["status"] == "completed"
        again = c.get(f"/v1/videos/{final2['id']}/content").content
        assert again == r.content  # same seed, same bytes

        listed = c.get("/v1/videos", params={"order": "asc"}).json()
        ids = [v["id"] for v in listed["data"]]
        assert ids.index(created["id"]) < ids.index(final2["id"])
        page = c.get("/v1/videos", params={"limit": 1}).json()
        assert len(page["data"]) == 1 and page["has_more"] is True
        for vid in (created["id"], final2["id"]):
            assert c.delete(f"/v1/videos/{vid}").json() == {
                "id": vid,
                "object": "video.deleted",
                "deleted": True,
            }
            assert c.get(f"/v1/videos/{vid}").status_code == 404


def test_failed_video_job_then_next_job_succeeds(video_server: Running) -> None:
    with video_server.client() as c:
        bad = c.post("/v1/videos", json=video_body(prompt=f"{TRIGGER} now")).json()
        good = c.post("/v1/videos", json=video_body(seed=6)).json()
        final, _ = wait_video(c, bad["id"])
        assert final["status"] == "failed"
        message = final["error"]["message"]
        assert message.startswith("The model failed while generating a 32x32 video of 5 frames, 1 step;")
        assert "injected" not in message and "RuntimeError" not in message
        assert final["error"]["code"] == "generation_failed"
        r = c.get(f"/v1/videos/{bad['id']}/content")
        assert r.status_code == 409 and r.json()["error"]["param"] == "video_id"
        final, _ = wait_video(c, good["id"])
        assert final["status"] == "completed", final
        frames = iio.imread(c.get(f"/v1/videos/{good['id']}/content").content, extension=".mp4")
        assert frames.shape == (5, 32, 32, 3)
        assert c.get("/health").status_code == 200


def test_queue_limit_cancel_and_delete(video_server: Running) -> None:
    engine = video_server.state.engine
    engine.release.clear()
    with video_server.client() as c:
        try:
            running = c.post("/v1/videos", json=video_body(prompt=f"{HOLD} a cat")).json()
            wait_status(c, running["id"], "in_progress")  # held until released below
            queued = [
                c.post("/v1/videos", json=video_body()).json() for _ in range(2)
            ]  # max_queue=2
            r = c.post("/v1/videos", json=video_body())
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "rate_limit_error"
            assert metric(scrape(c), "diffusion_offload_queue_depth") == 2
            assert c.get(f"/v1/videos/{queued[0]['id']}").json()["status"] == "queued"
            r = c.get(f"/v1/videos/{running['id']}/content")
            assert r.status_code == 409
            for job in queued:  # cancel both queued jobs: they never run
                assert c.delete(f"/v1/videos/{job['id']}").status_code == 200
                assert c.get(f"/v1/videos/{job['id']}").status_code == 404
            listed = [v["id"] for v in c.get("/v1/videos").json()["data"]]
            assert running["id"] in listed and not {q["id"] for q in queued} & set(listed)
            before = metric(scrape(c), "diffusion_offload_jobs_total", kind="video", status="cancelled")
            r = c.delete(f"/v1/videos/{running['id']}")  # running: cancelled, stops at its next step
            assert r.status_code == 200 and r.json() == {
                "id": running["id"], "object": "video.deleted", "deleted": True}
            assert c.get(f"/v1/videos/{running['id']}").status_code == 404
        finally:
            engine.release.set()
        deadline = time.monotonic() + 60
        while video_server.state.jobs.running_count and time.monotonic() < deadline:
            time.sleep(0.02)
        samples = scrape(c)
        assert metric(samples, "diffusion_offload_jobs_total", kind="video", status="cancelled") == before + 1
        assert metric(samples, "diffusion_offload_jobs_running") == 0
        assert metric(samples, "diffusion_offload_queue_depth") == 0


# ---------------------------------------------------------------------- bad requests


def _chunks(n: int) -> Iterator[bytes]:
    for _ in range(n):
        yield b" " * 8192


BIG = json.dumps({"prompt": "a" * (MAX_BODY + 10)})
BAD_REQUESTS = [
    # (id, server, method, path, request kwargs, status, param)
    ("missing prompt", "image", "POST", IMG, {"json": {"n": 1}}, 400, "prompt"),
    ("prompt not a string", "image", "POST", IMG, {"json": {"prompt": 12}}, 400, "prompt"),
    ("empty prompt", "image", "POST", IMG, {"json": {"prompt": ""}}, 400, "prompt"),
    ("n=0", "image", "POST", IMG, {"json": {"prompt": "a", "n": 0}}, 400, "n"),
    ("n=11", "image", "POST", IMG, {"json": {"prompt": "a", "n": 11}}, 400, "n"),
    ("n as string", "image", "POST", IMG, {"json": {"prompt": "a", "n": "2"}}, 400, "n"),
    ("n as bool", "image", "POST", IMG, {"json": {"prompt": "a", "n": True}}, 400, "n"),
    ("size abc", "image", "POST", IMG, {"json": {"prompt": "a", "size": "abc"}}, 400, "size"),
    ("size 0x16", "image", "POST", IMG, {"json": {"prompt": "a", "size": "0x16"}}, 400, "size"),
    (
        "size over max pixels",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a", "size": "128x128"}},
        400,
        "size",
    ),
    (
        "size not a multiple of the model's 4 (VAE scale 2 x packed patch 2)",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a", "size": "16x18"}},
        400,
        "size",
    ),
    ("size as number", "image", "POST", IMG, {"json": {"prompt": "a", "size": 512}}, 400, "size"),
    (
        "negative steps",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a", "num_inference_steps": -1}},
        400,
        "num_inference_steps",
    ),
    (
        "steps over max",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a", "num_inference_steps": 9}},
        400,
        "num_inference_steps",
    ),
    (
        "guidance not a number",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a", "guidance_scale": "high"}},
        400,
        "guidance_scale",
    ),
    ("negative seed", "image", "POST", IMG, {"json": {"prompt": "a", "seed": -1}}, 400, "seed"),
    (
        "response_format png",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a", "response_format": "png"}},
        400,
        "response_format",
    ),
    ("user not a string", "image", "POST", IMG, {"json": {"prompt": "a", "user": 5}}, 400, "user"),
    (
        "unknown field",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a", "colour": "red"}},
        400,
        "colour",
    ),
    (
        "video field on images",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a", "num_frames": 5}},
        400,
        "num_frames",
    ),
    (
        "wrong model name",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a", "model": "dall-e-3"}},
        400,
        "model",
    ),
    (
        "image request to a video model",
        "video",
        "POST",
        IMG,
        {"json": {"prompt": "a"}},
        400,
        "model",
    ),
    (
        "video request to an image model",
        "image",
        "POST",
        "/v1/videos",
        {"json": {"prompt": "a"}},
        400,
        "model",
    ),
    (
        "bad JSON",
        "image",
        "POST",
        IMG,
        {"content": b"{bad", "headers": {"content-type": "application/json"}},
        400,
        None,
    ),
    ("JSON array", "image", "POST", IMG, {"json": [{"prompt": "a"}]}, 400, None),
    (
        "wrong content type",
        "image",
        "POST",
        IMG,
        {"content": b"prompt=a", "headers": {"content-type": "text/plain"}},
        400,
        None,
    ),
    (
        "form to the JSON-only images endpoint",
        "image",
        "POST",
        IMG,
        {"data": {"prompt": "a"}},
        400,
        None,
    ),
    (
        "oversized body",
        "image",
        "POST",
        IMG,
        {"content": BIG, "headers": {"content-type": "application/json"}},
        413,
        None,
    ),
    (
        "oversized chunked body",
        "video",
        "POST",
        "/v1/videos",
        {"content": _chunks, "headers": {"content-type": "application/json"}},
        413,
        None,
    ),
    (
        "missing API key",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a"}, "headers": {"Authorization": ""}},
        401,
        None,
    ),
    (
        "wrong API key",
        "image",
        "POST",
        IMG,
        {"json": {"prompt": "a"}, "headers": {"Authorization": "Bearer nope"}},
        401,
        None,
    ),
    (
        "basic auth instead of bearer",
        "video",
        "GET",
        "/v1/videos",
        {"headers": {"Authorization": f"Basic {API_KEY}"}},
        401,
        None,
    ),
    (
        "frames over max",
        "video",
        "POST",
        "/v1/videos",
        {"json": {"prompt": "a", "num_frames": 13}},
        400,
        "num_frames",
    ),
    (
        "frames not 4k+1",
        "video",
        "POST",
        "/v1/videos",
        {"json": {"prompt": "a", "num_frames": 6}},
        400,
        "num_frames",
    ),
    (
        "frames zero",
        "video",
        "POST",
        "/v1/videos",
        {"json": {"prompt": "a", "num_frames": 0}},
        400,
        "num_frames",
    ),
    ("fps zero", "video", "POST", "/v1/videos", {"json": {"prompt": "a", "fps": 0}}, 400, "fps"),
    (
        "video steps over max",
        "video",
        "POST",
        "/v1/videos",
        {"json": {"prompt": "a", "num_inference_steps": 100}},
        400,
        "num_inference_steps",
    ),
    (
        "guidance_scale_2 wrong type",
        "video",
        "POST",
        "/v1/videos",
        {"json": {"prompt": "a", "guidance_scale_2": [1]}},
        400,
        "guidance_scale_2",
    ),
    (
        "video missing prompt",
        "video",
        "POST",
        "/v1/videos",
        {"json": {"size": "32x32"}},
        400,
        "prompt",
    ),
    (
        "multipart unknown field",
        "video",
        "POST",
        "/v1/videos",
        {"files": {"prompt": (None, "a"), "seconds": (None, "4")}},
        400,
        "seconds",
    ),
    (
        "multipart frames not an int",
        "video",
        "POST",
        "/v1/videos",
        {"files": {"prompt": (None, "a"), "num_frames": (None, "many")}},
        400,
        "num_frames",
    ),
    (
        "multipart file upload",
        "video",
        "POST",
        "/v1/videos",
        {"files": {"prompt": (None, "a"), "input_reference": ("ref.png", b"\x89PNG", "image/png")}},
        400,
        "input_reference",
    ),
    (
        "video bad JSON",
        "video",
        "POST",
        "/v1/videos",
        {"content": b"[", "headers": {"content-type": "application/json"}},
        400,
        None,
    ),
    (
        "video wrong content type",
        "video",
        "POST",
        "/v1/videos",
        {"content": b"a", "headers": {"content-type": "text/plain"}},
        400,
        None,
    ),
    ("unknown job id", "video", "GET", "/v1/videos/video_nope", {}, 404, "video_id"),
    ("unknown job content", "video", "GET", "/v1/videos/video_nope/content", {}, 404, "video_id"),
    ("delete unknown job", "video", "DELETE", "/v1/videos/video_nope", {}, 404, "video_id"),
    ("list limit 0", "video", "GET", "/v1/videos", {"params": {"limit": 0}}, 400, "limit"),
    (
        "list bad order",
        "video",
        "GET",
        "/v1/videos",
        {"params": {"order": "sideways"}},
        400,
        "order",
    ),
    ("unknown model id", "image", "GET", "/v1/models/dall-e-3", {}, 404, "model"),
    ("unknown path", "image", "GET", "/v1/nope", {}, 404, None),
    ("method not allowed", "image", "PUT", "/v1/videos", {"json": {}}, 405, None),
]


@pytest.fixture(scope="module")
def servers(image_server: Running, video_server: Running) -> dict[str, Running]:
    """Both servers by name."""
    return {"image": image_server, "video": video_server}


@pytest.mark.parametrize(
    "server,method,path,kwargs,status,param",
    [row[1:] for row in BAD_REQUESTS],
    ids=[row[0] for row in BAD_REQUESTS],
)
def test_bad_requests(
    servers: dict[str, Running],
    server: str,
    method: str,
    path: str,
    kwargs: dict,
    status: int,
    param: str | None,
) -> None:
    kwargs = dict(kwargs)
    if callable(kwargs.get("content")):
        kwargs["content"] = kwargs["content"](2 * MAX_BODY // 8192)  # chunked: no Content-Length
    with servers[server].client() as c:
        r = c.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] == param, err


def test_bad_request_table_size_and_health_after(servers: dict[str, Running]) -> None:
    assert len(BAD_REQUESTS) >= 25
    for running in servers.values():
        assert httpx.get(f"{running.url}/health").status_code == 200
        samples = scrape(running.client())
        assert metric(samples, "diffusion_offload_jobs_running") == 0


# ---------------------------------------------------------------------- loading, jobs, CLI


class _StubEngine:
    """A trivial image engine: grey images of the requested size."""

    is_video = False

    def generate(self, prompts: Any, params: Any) -> list[GenerationOutput]:
        size = (params.width or 16, params.height or 16)
        return [
            GenerationOutput(
                prompt=str(prompts), images=[Image.new("RGB", size, (params.seed or 0) % 256)]
            )
        ]


def test_health_is_503_until_the_model_is_loaded() -> None:
    release = threading.Event()

    def factory() -> _StubEngine:
        release.wait(30)
        return _StubEngine()

    running = start_server(factory, ServerSettings(model_id="stub"), wait_healthy=False)
    try:
        r = httpx.get(f"{running.url}/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = httpx.post(f"{running.url}{IMG}", json={"prompt": "a"})
        assert r.status_code == 503 and set(r.json()["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        assert httpx.get(f"{running.url}/v1/models").json()["data"][0]["id"] == "stub"
        release.set()
        wait_health(running.url, timeout=10)
        r = httpx.post(f"{running.url}{IMG}", json={"prompt": "a", "size": "32x16", "seed": 3})
        assert r.status_code == 200
        assert decode_png(r.json()["data"][0]["b64_json"])[1].size == (32, 16)
    finally:
        release.set()
        running.stop()


def test_failed_model_load_is_reported_on_health() -> None:
    def factory() -> _StubEngine:
        raise FileNotFoundError("no weights here")

    running = start_server(factory, ServerSettings(model_id="broken"), wait_healthy=False)
    try:
        deadline = time.monotonic() + 10
        while running.state.load_error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(f"{running.url}/health")
        assert r.status_code == 503
        assert r.json() == {"status": "failed"}  # no key needed, so no detail (paths) given
        r = httpx.post(f"{running.url}{IMG}", json={"prompt": "a"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
        assert "no weights here" not in r.text
    finally:
        running.stop()


def test_job_manager_shutdown_grace() -> None:
    gate = threading.Event()

    def runner(job: Job) -> str:
        if job.payload == "slow":
            gate.wait(10)
        return f"done {job.payload}"

    # the running job outlives the grace: marked failed, its late result dropped; queued jobs fail
    jobs = JobManager(runner, max_queue=4)
    jobs.start()
    slow, waiting = Job("video", "slow", store=True), Job("video", "next", store=True)
    jobs.submit(slow)
    jobs.submit(waiting)
    while slow.status != "in_progress":
        time.sleep(0.01)
    start = time.monotonic()
    assert jobs.shutdown(grace=0.3, settle=0.1) is False
    assert 0.25 < time.monotonic() - start < 5
    assert slow.status == "failed" and slow.error["code"] == "server_shutdown"
    assert waiting.status == "failed" and waiting.error["code"] == "server_shutdown"
    gate.set()
    time.sleep(0.1)
    assert slow.status == "failed" and slow.result is None

    # the running job finishes within the grace: completed
    gate.clear()
    jobs = JobManager(runner, max_queue=4)
    jobs.start()
    slow = jobs.submit(Job("video", "slow", store=True))
    while slow.status != "in_progress":
        time.sleep(0.01)
    threading.Timer(0.2, gate.set).start()
    assert jobs.shutdown(grace=10) is True
    assert slow.status == "completed" and slow.result == "done slow"


def test_cli_bad_config_exits_2_with_one_line(model_dirs: dict[str, Path]) -> None:
    proc = subprocess.run(
        [*cli(), "serve", str(model_dirs["wan2.1"]), "--diffusion-offload-config", "{bad"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("diffusion-offload: error: --diffusion-offload-config")
    assert proc.stdout == ""


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (
            ["--diffusion-offload-config", '{"mode": "module", "components": ["vae"]}'],
            "--diffusion-offload-config",
        ),
        (["--max-queue", "0"], "--max-queue"),
        (["--max-pixels", "-5"], "--max-pixels"),
        (["--shutdown-grace", "-1"], "--shutdown-grace"),
        (["--device", "warp-drive"], "warp-drive"),
    ],
)
def test_cli_serve_validates_before_loading(
    model_dirs: dict[str, Path], capsys: pytest.CaptureFixture, argv: list[str], fragment: str
) -> None:
    from diffusion_offload.cli import main

    assert main(["serve", str(model_dirs["wan2.1"]), *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("diffusion-offload: error: ")
        and fragment in lines[0]
    ), lines


def test_cli_serve_missing_model_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from diffusion_offload.cli import main

    assert main(["serve", str(tmp_path / "nothing-here")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffusion-offload: error: ")


def test_cli_serve_truncated_weights_exit_2_before_binding(
    model_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from diffusion_offload.cli import main

    broken = tmp_path / "broken"
    shutil.copytree(model_dirs["wan2.1"], broken)
    weights = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    data = weights.read_bytes()
    header = int.from_bytes(data[:8], "little")
    weights.write_bytes(data[: 8 + header + 10])  # an interrupted download: the data is cut
    status = main(["serve", str(broken), "--device", "fakegpu", "--port", "0"])
    assert status == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"diffusion-offload: error: weight file '{weights}' cannot be read: "
                               "truncated or corrupt")


def test_cli_serve_model_that_fails_to_load_stops_the_server(
    model_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from diffusion_offload.cli import main

    broken = tmp_path / "broken"
    shutil.copytree(model_dirs["wan2.1"], broken)
    (broken / "transformer" / "config.json").write_text("{not json")  # only the load finds it
    with caplog.at_level("INFO"):
        status = main(["serve", str(broken), "--device", "fakegpu", "--port", "0"])
    assert status in (1, 2)
    assert "the model failed to load" in caplog.text


def test_sigterm_graceful_shutdown(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    port = free_port()
    # torch's own compile cache (TORCHINDUCTOR_CACHE_DIR, set by importing torch) is inherited,
    # so anything left in TMPDIR would be the server's
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmpdir)}
    proc = subprocess.Popen(
        [
            *cli(),
            "serve",
            str(model_dirs["wan2.1"]),
            "--omni",
            "--device",
            "fakegpu",
            "--port",
            str(port),
            "--diffusion-offload-config",
            json.dumps(CONFIG),
            "--shutdown-grace",
            "1",
            "--max-queue",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, proc=proc)
        with httpx.Client(base_url=url, timeout=30) as c:
            long_job = c.post(
                "/v1/videos", json=video_body(num_inference_steps=100, guidance_scale=5.0)
            ).json()
            queued = c.post("/v1/videos", json=video_body()).json()
            wait_status(c, long_job["id"], "in_progress")
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            # new work is refused at once (503), or the listener is already closed
            try:
                r = c.post("/v1/videos", json=video_body())
                assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
            except httpx.TransportError:
                pass
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert elapsed < 15, f"shutdown took {elapsed:.1f} s with a 1 s grace"
    assert f"job {long_job['id']} marked failed" in err, err
    assert queued["status"] == "queued"
    assert "Traceback" not in err, err
    for noise in ("Loading pipeline components", "Loading weights", "torchvision", "it/s]"):
        assert noise not in err, f"serve printed {noise!r}: {err}"  # quiet loading, as generate
    assert list(tmpdir.iterdir()) == [], "temporary files left behind"
