"""Issue 9, server side: hostile and careless input against real servers on loopback.

Most tests serve a stub engine (no model: each request takes milliseconds) through the
real app on uvicorn, on a free 127.0.0.1 port, and talk to it with httpx or raw HTTP.
The OpenAI-client test and the CLI tests use a real tiny Wan2.1 / Flux model.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import random
import shutil
import socket
import string
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import pytest  # noqa: E402
import uvicorn  # noqa: E402
from PIL import Image  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from diffusion_offload.engine import GenerationOutput  # noqa: E402
from diffusion_offload.server import ServerSettings, create_app  # noqa: E402
from diffusion_offload.server.jobs import Job, JobManager  # noqa: E402

IMG = "/v1/images/generations"
EVIL = "https://evil.example"


class StubEngine:
    """A fast engine double: images or videos of the requested size; a prompt with
    ``HOLD`` waits for ``release``; ``CRASH`` raises with a host path in the message."""

    def __init__(self, video: bool = False, info: Any = None) -> None:
        self.is_video = video
        self.release = threading.Event()
        self.prompts: list[str] = []
        if info is not None:
            self.info = info

    def generate(self, prompts: Any, params: Any) -> list[GenerationOutput]:
        text = prompts if isinstance(prompts, str) else prompts["prompt"]
        self.prompts.append(text)
        if "HOLD" in text:
            assert self.release.wait(30)
        if "CRASH" in text:
            raise RuntimeError("shape '[1, 1, 52, -1]' is invalid in /home/alice/models/secret.py")
        size = (params.width or 16, params.height or 16)
        if self.is_video:
            frame = Image.new("RGB", size, 90)
            return [GenerationOutput(prompt=text, frames=[[frame] * (params.num_frames or 1)])]
        n = params.num_outputs_per_prompt or 1
        return [GenerationOutput(prompt=text, images=[Image.new("RGB", size, 7)] * n)]


class Served:
    """``create_app(engine, settings)`` on uvicorn in a thread, on a free loopback port."""

    def __init__(self, engine: Any, **settings: Any) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.settings = ServerSettings(model_id="stub", host="127.0.0.1", **settings)
        self.app = create_app(engine, self.settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.port}"
        self.state = self.app.state.server

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)

    def raw(self, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, bytes]:
        """One request with exactly these headers (``Host`` may be overridden)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            hdrs = {"Host": f"127.0.0.1:{self.port}", **(headers or {})}
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture()
def image_stub() -> Iterator[Served]:
    served = Served(StubEngine())
    yield served
    served.state.engine.release.set()
    served.stop()


@pytest.fixture()
def video_stub() -> Iterator[Served]:
    served = Served(StubEngine(video=True), max_stored_jobs=3, job_ttl=1.0)
    yield served
    served.stop()


def series(client: httpx.Client) -> set[tuple[str, frozenset]]:
    out = set()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            out.add((sample.name, frozenset(sample.labels.items())))
    return out


def value(client: httpx.Client, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def wait_done(c: httpx.Client, job_id: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = c.get(f"/v1/videos/{job_id}").json()
        if job["status"] in ("completed", "failed"):
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} did not finish")


# ---------------------------------------------------------------------- cross-site


def test_cross_site_requests_are_refused_and_queue_nothing(video_stub: Served) -> None:
    s = video_stub
    form = b"prompt=pwned&size=32x32&num_frames=5"
    cases = {
        "cross-origin form post": ("POST", "/v1/videos", form, {
            "Content-Type": "application/x-www-form-urlencoded", "Origin": EVIL}),
        "JSON post, foreign Origin": ("POST", "/v1/videos", b'{"prompt": "x"}', {
            "Content-Type": "application/json", "Origin": EVIL}),
        "Origin null (sandboxed page)": ("POST", "/v1/videos", b'{"prompt": "x"}', {
            "Content-Type": "application/json", "Origin": "null"}),
        "Sec-Fetch-Site cross-site": ("POST", "/v1/videos", b'{"prompt": "x"}', {
            "Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"}),
        "foreign Host (DNS rebinding), POST": ("POST", "/v1/videos", b'{"prompt": "x"}', {
            "Content-Type": "application/json", "Host": f"evil.example:{s.port}"}),
        "foreign Host, GET": ("GET", "/v1/videos", b"", {"Host": f"evil.example:{s.port}"}),
        "same-origin page on another port": ("POST", "/v1/videos", b'{"prompt": "x"}', {
            "Content-Type": "application/json", "Origin": "http://127.0.0.1:1"}),
    }
    for label, (method, path, body, headers) in cases.items():
        status, data = s.raw(method, path, body, headers)
        assert status == 403, f"{label}: {status} {data!r}"
        err = json.loads(data)["error"]
        assert err["type"] == "permission_error" and err["code"] == "forbidden", label
    assert s.state.jobs.list() == []
    assert s.state.engine.prompts == []

    ok = {
        "curl-style, no Origin": {"Content-Type": "application/json"},
        "same-origin browser request": {"Content-Type": "application/json", "Origin": s.url,
                                        "Sec-Fetch-Site": "same-origin"},
        "Host localhost:PORT": {"Content-Type": "application/json", "Host": f"localhost:{s.port}"},
    }
    for label, headers in ok.items():
        status, data = s.raw("POST", "/v1/videos", b'{"prompt": "fine", "size": "16x16", "num_frames": 2}',
                             headers)
        assert status == 200, f"{label}: {status} {data!r}"
    assert len(s.state.jobs.list()) == 3


def test_form_urlencoded_bodies_are_checked_like_multipart(video_stub: Served) -> None:
    status, data = video_stub.raw("POST", "/v1/videos", b"prompt=x&size=16x16&num_frames=2", {
        "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 200, data
    status, data = video_stub.raw("POST", "/v1/videos", b"prompt=x&num_frames=many", {
        "Content-Type": "application/x-www-form-urlencoded"})
    assert status == 400 and json.loads(data)["error"]["param"] == "num_frames"
    status, data = video_stub.raw("POST", "/v1/videos", b"prompt=x", {  # the cross-site guard
        "Content-Type": "application/x-www-form-urlencoded", "Origin": "https://evil.example"})
    assert status == 403
    assert len(video_stub.state.jobs.list()) == 1


def test_allowed_origins_and_hosts_extend_the_lists() -> None:
    served = Served(StubEngine(), allowed_origins=("http://localhost:3000",), allowed_hosts=("myhost.lan",))
    try:
        body = json.dumps({"prompt": "a", "size": "16x16"}).encode()
        json_type = {"Content-Type": "application/json"}
        status, _ = served.raw("POST", IMG, body, {**json_type, "Origin": "http://localhost:3000"})
        assert status == 200
        status, _ = served.raw("POST", IMG, body, {**json_type, "Host": f"myhost.lan:{served.port}"})
        assert status == 200
        status, _ = served.raw("POST", IMG, body, {**json_type, "Origin": "http://localhost:4000"})
        assert status == 403
        with served.client() as c:  # CORS preflight for the allowed origin
            r = c.options(IMG, headers={"Origin": "http://localhost:3000",
                                        "Access-Control-Request-Method": "POST"})
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    finally:
        served.stop()
    with pytest.raises(ValueError, match="--allowed-origins: 'localhost:3000' is not an origin"):
        ServerSettings(model_id="x", allowed_origins=("localhost:3000",))


# ---------------------------------------------------------------------- metrics


def test_metric_series_stay_bounded_under_random_methods_and_paths(image_stub: Served) -> None:
    rng = random.Random(0)
    paths = ["/health", "/metrics", "/v1/models", "/v1/models/stub", IMG, "/v1/videos",
             "/v1/videos/abc", "/v1/videos/abc/content", "/nope"]

    def junk_method() -> str:
        return "".join(rng.choice(string.ascii_uppercase) for _ in range(rng.randint(3, 10)))

    def junk_path() -> str:
        return "/" + "".join(rng.choice(string.ascii_lowercase + "/") for _ in range(rng.randint(1, 20)))

    with image_stub.client() as c:
        for path in paths:  # each route's first request (an invented method)
            image_stub.raw(junk_method(), path)
        series(c)  # the scrape's own first request (GET /metrics) makes its series
        before = series(c)
        for i in range(1000):
            image_stub.raw(junk_method(), rng.choice(paths) if i % 2 else junk_path())
        after = series(c)
    assert after == before, sorted(after - before)[:5]
    methods = {dict(labels).get("method") for name, labels in after if name.startswith("diffusion_offload_http")}
    assert methods <= {None, "GET", "POST", "DELETE", "other"}


# ---------------------------------------------------------------------- jobs


def test_finished_jobs_expire_and_the_store_is_bounded(video_stub: Served) -> None:
    with video_stub.client() as c:
        ids = []
        for i in range(5):
            r = c.post("/v1/videos", json={"prompt": f"cat {i}", "size": "16x16", "num_frames": 2})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
            assert wait_done(c, ids[-1])["status"] == "completed"
        listed = [j["id"] for j in c.get("/v1/videos?limit=100").json()["data"]]
        assert listed == ids[:-4:-1]  # the newest 3 (--max-stored-jobs 3), newest first
        assert [c.get(f"/v1/videos/{i}").status_code for i in ids[:2]] == [404, 404]
        assert c.get(f"/v1/videos/{ids[-1]}/content").status_code == 200
        time.sleep(1.2)  # --job-ttl 1
        assert c.get(f"/v1/videos/{ids[-1]}").status_code == 404
        assert c.get("/v1/videos").json()["data"] == []
        assert video_stub.state.jobs.stored == 0


def test_deleting_a_finished_job_counts_it_once(video_stub: Served) -> None:
    with video_stub.client() as c:
        job = c.post("/v1/videos", json={"prompt": "x", "size": "16x16", "num_frames": 2}).json()
        wait_done(c, job["id"])
        labels = {"kind": "video", "status": "completed"}
        count = value(c, "diffusion_offload_jobs_total", **labels)
        runs = value(c, "diffusion_offload_job_run_seconds_count", kind="video")
        assert (count, runs) == (1.0, 1.0)
        assert c.delete(f"/v1/videos/{job['id']}").json()["deleted"] is True
        assert value(c, "diffusion_offload_jobs_total", **labels) == 1.0
        assert value(c, "diffusion_offload_job_run_seconds_count", kind="video") == 1.0


def test_job_manager_counts_each_job_once() -> None:
    seen: list[str] = []
    jobs = JobManager(lambda job: "ok", max_queue=4, on_finish=lambda job: seen.append(job.id))
    jobs.start()
    job = jobs.submit(Job("video", None, store=True))
    deadline = time.monotonic() + 5
    while not job.finished and time.monotonic() < deadline:
        time.sleep(0.01)
    jobs.delete(job.id)
    assert jobs.cancel(job) is False
    jobs.shutdown(0.1)
    assert seen == [job.id]


def test_disconnected_client_cancels_its_queued_image(image_stub: Served) -> None:
    engine = image_stub.state.engine
    holder = threading.Thread(
        target=lambda: httpx.post(f"{image_stub.url}{IMG}", json={"prompt": "HOLD", "size": "16x16"}, timeout=30)
    )
    holder.start()
    deadline = time.monotonic() + 10
    while engine.prompts != ["HOLD"] and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(httpx.ReadTimeout):  # queued behind HOLD; the client gives up
        httpx.post(f"{image_stub.url}{IMG}", json={"prompt": "abandoned", "size": "16x16"}, timeout=0.5)
    deadline = time.monotonic() + 10
    while image_stub.state.jobs.queue_depth and time.monotonic() < deadline:
        time.sleep(0.02)
    assert image_stub.state.jobs.queue_depth == 0
    engine.release.set()
    holder.join(30)
    with image_stub.client() as c:
        assert value(c, "diffusion_offload_jobs_total", kind="image", status="cancelled") == 1.0
    assert engine.prompts == ["HOLD"]  # the abandoned request never ran


# ---------------------------------------------------------------------- errors and keys


def test_5xx_is_generic_with_a_request_id(image_stub: Served, caplog: pytest.LogCaptureFixture) -> None:
    def boom() -> None:
        raise OSError("cannot open /home/alice/.cache/secret/weights.bin")

    image_stub.app.add_api_route("/v1/boom", boom)
    with caplog.at_level("ERROR"), image_stub.client() as c:
        r = c.get("/v1/boom")
        assert r.status_code == 500
        err = r.json()["error"]
        request_id = r.headers["x-request-id"]
        assert err["message"] == (f"Internal server error (request id {request_id}); "
                                  "the server log has the details.")
        assert "/home/alice" not in r.text and "OSError" not in r.text
        r = c.post(IMG, json={"prompt": "CRASH", "size": "16x16"})
        assert r.status_code == 500
        assert "secret" not in r.text and "shape" not in r.text
        assert "16x16 image" in r.json()["error"]["message"]
    assert request_id in caplog.text and "/home/alice/.cache" in caplog.text


def test_failed_video_job_names_what_failed_in_the_users_terms(video_stub: Served) -> None:
    with video_stub.client() as c:
        job = c.post("/v1/videos", json={"prompt": "CRASH", "size": "32x16", "num_frames": 3}).json()
        done = wait_done(c, job["id"])
        assert done["status"] == "failed"
        message = done["error"]["message"]
        assert message.startswith("The model failed while generating a 32x16 video of 3 frames")
        assert "shape" not in message and "RuntimeError" not in message and "/home" not in message


def test_health_without_a_key_says_only_the_status() -> None:
    served = Served(StubEngine(), api_key="k3y")
    try:
        assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    finally:
        served.stop()


def test_api_key_must_be_printable_ascii_and_matches_as_bytes() -> None:
    for bad in ("clé-secrète", "two words", "tab\tkey"):
        with pytest.raises(ValueError, match="--api-key: character"):
            ServerSettings(model_id="x", api_key=bad)
    served = Served(StubEngine(), api_key="s3cr3t-KEY_~!")
    try:
        with served.client() as c:
            assert c.get("/v1/models", headers={"Authorization": "Bearer s3cr3t-KEY_~!"}).status_code == 200
            assert c.get("/v1/models", headers={"Authorization": "Bearer s3cr3t-KEY_~"}).status_code == 401
        status, _ = served.raw("GET", "/v1/models", headers={"Authorization": "Bearer s3cr3t-KEY_~!\xe9"})
        assert status == 401
    finally:
        served.stop()


# ---------------------------------------------------------------------- omitted fields


@pytest.fixture(scope="module")
def wan_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from diffusion_offload.testing import tiny_pipelines

    root = tmp_path_factory.mktemp("wan")
    tiny = tiny_pipelines.save("wan2.1", root / "tiny")
    plain = shutil.copytree(tiny, root / "plain")  # the same files, without the make-tiny marker
    (plain / tiny_pipelines.MARKER).unlink()
    return {"tiny": tiny, "plain": plain}


def test_omitted_fields_take_the_models_defaults_under_the_limits(wan_dirs: dict[str, Path]) -> None:
    from diffusion_offload.models.files import inspect_model

    limits = {"max_frames": 5, "max_steps": 2, "max_pixels": 1024}
    tiny = Served(StubEngine(video=True, info=inspect_model(wan_dirs["tiny"])), **limits)
    plain = Served(StubEngine(video=True, info=inspect_model(wan_dirs["plain"])), **limits)
    try:
        with tiny.client() as c:  # a make-tiny model: its small defaults (32x32, 5 frames, 2 steps)
            job = c.post("/v1/videos", json={"prompt": "x"}).json()
            assert (job["size"], job["num_frames"]) == ("32x32", 5)
            assert wait_done(c, job["id"])["status"] == "completed"
            r = c.post("/v1/videos", json={"prompt": "x", "num_frames": 9})
            assert r.status_code == 400 and "(--max-frames)" in r.json()["error"]["message"]
        with plain.client() as c:  # the pipeline's defaults (81 frames, 480x832, 50 steps) are over
            r = c.post("/v1/videos", json={"prompt": "x"})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == "size"
            assert "'size' was omitted and the model's default (832x480 = 399360 pixels)" in err["message"]
            r = c.post("/v1/videos", json={"prompt": "x", "size": "32x32"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "num_inference_steps"
            r = c.post("/v1/videos", json={"prompt": "x", "size": "32x32", "num_inference_steps": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "num_frames"
            assert plain.state.jobs.list() == []
    finally:
        tiny.stop()
        plain.stop()


def test_seconds_is_converted_to_frames_the_model_accepts(wan_dirs: dict[str, Path]) -> None:
    from diffusion_offload.models.files import inspect_model

    served = Served(StubEngine(video=True, info=inspect_model(wan_dirs["tiny"])), max_frames=129)
    try:
        with served.client() as c:
            for seconds, fps, frames in (("4", None, 65), (1, 16, 17), ("0.5", 10, 5), ("2", 3, 5)):
                body = {"prompt": "x", "seconds": seconds, **({"fps": fps} if fps else {})}
                job = c.post("/v1/videos", json=body).json()
                assert job["num_frames"] == frames, (seconds, fps, job)
            r = c.post("/v1/videos", json={"prompt": "x", "seconds": "4", "num_frames": 5})
            assert r.status_code == 400 and "give 'seconds' or 'num_frames', not both" in r.text
            r = c.post("/v1/videos", json={"prompt": "x", "seconds": "soon"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seconds"
            r = c.post("/v1/videos", json={"prompt": "x", "seconds": "9"})  # 145 frames > 129
            assert r.status_code == 400 and "'seconds'" in r.json()["error"]["message"]
    finally:
        served.stop()


# ---------------------------------------------------------------------- the OpenAI client


def test_official_openai_client_images_and_videos(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai", reason="the openai package is a test extra: pip install -e '.[test]'")
    from diffusion_offload.engine import Omni
    from diffusion_offload.testing import tiny_pipelines

    flux = tiny_pipelines.save("flux", tmp_path / "flux")
    wan = tiny_pipelines.save("wan2.1", tmp_path / "wan")
    image = Served(Omni(str(flux), device="cpu", progress=False), api_key="sk-test")
    video = Served(Omni(str(wan), device="cpu", progress=False), api_key="sk-test")
    try:
        client = openai.OpenAI(base_url=f"{image.url}/v1", api_key="sk-test", max_retries=0)
        result = client.images.generate(model="stub", prompt="a red car", size="32x32", n=2,
                                        response_format="b64_json")
        pngs = [base64.b64decode(item.b64_json) for item in result.data]
        assert len(pngs) == 2 and all(p.startswith(b"\x89PNG") for p in pngs)
        # response_format="url": served here, with the same key, kept as a job (--job-ttl)
        result = client.images.generate(model="stub", prompt="a red car", size="32x32", n=2,
                                        response_format="url", extra_body={"seed": 3})
        again = client.images.generate(model="stub", prompt="a red car", size="32x32", n=2,
                                       response_format="b64_json", extra_body={"seed": 3})
        urls = [item.url for item in result.data]
        assert all(u.startswith(f"{image.url}/v1/images/image_") for u in urls), urls
        with httpx.Client(timeout=30) as c:
            fetched = [c.get(u, headers={"Authorization": "Bearer sk-test"}) for u in urls]
            assert [r.status_code for r in fetched] == [200, 200]
            assert [r.content for r in fetched] == [base64.b64decode(i.b64_json) for i in again.data]
            assert c.get(urls[0]).status_code == 401  # the same auth as the API
            missing = urls[0].rsplit("/", 1)[0] + "/2.png"
            assert c.get(missing, headers={"Authorization": "Bearer sk-test"}).status_code == 404
        assert image.state.jobs.stored == 1  # counted in --max-stored-jobs

        client = openai.OpenAI(base_url=f"{video.url}/v1", api_key="sk-test", max_retries=0)
        job = client.videos.create(model="stub", prompt="a cat", seconds="4", size="32x32",
                                   extra_body={"fps": 2})  # 4 s at 2 fps: 8 -> 9 frames (4k+1)
        assert job.status == "queued" and job.id.startswith("video_")
        deadline = time.monotonic() + 60
        while job.status not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.2)
            job = client.videos.retrieve(job.id)
        assert job.status == "completed", job
        assert job.seconds == "4"  # echoed as given (9 frames at 2 fps)
        dump = job.to_dict()  # declared fields of the client's Video, and the extra ones
        assert dump["prompt"] == "a cat"
        assert dump["expires_at"] == job.completed_at + 3600  # --job-ttl
        content = client.videos.download_content(job.id)
        data = content.read()
        import imageio.v3 as iio

        frames = iio.imread(data, index=None, extension=".mp4")
        assert frames.shape == (9, 32, 32, 3)
        listed = [v.id for v in client.videos.list()]
        assert listed == [job.id]

        # a request the model cannot run is refused at validation, naming the model's limit
        for kwargs, field, limit in ((dict(seconds="8"), "seconds", "at most 125 frames"),
                                     (dict(size="1280x720"), "size", "at most 512 pixels a side")):
            with pytest.raises(openai.BadRequestError) as err:
                client.videos.create(model="stub", prompt="a cat", **kwargs)
            body = err.value.body
            assert body["param"] == field, body
            assert f"its transformer's rope_max_seq_len of 32 allows {limit}" in body["message"]

        # DELETE of a running job: deleted, stopped at its next step, then 404, counted
        running = client.videos.create(model="stub", prompt="a long cat", size="32x32",
                                       extra_body={"num_frames": 5, "num_inference_steps": 100})
        while client.videos.retrieve(running.id).status != "in_progress":
            time.sleep(0.01)
        kept = video.state.jobs.get(running.id)
        assert client.videos.delete(running.id).deleted is True
        with pytest.raises(openai.NotFoundError):
            client.videos.retrieve(running.id)
        deadline = time.monotonic() + 30
        while video.state.jobs.running_count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert video.state.jobs.running_count == 0
        assert kept.status == "failed" and kept.error["code"] == "cancelled"
        assert kept.progress < 99 and kept.result is None  # stopped before its last step
        samples = {(m.name, tuple(sorted(s.labels.items()))): s.value
                   for m in text_string_to_metric_families(httpx.get(f"{video.url}/metrics").text)
                   for s in m.samples}
        assert samples[("diffusion_offload_jobs", (("kind", "video"), ("status", "cancelled")))] == 1
    finally:
        image.stop()
        video.stop()


# ---------------------------------------------------------------------- serve on the command line


def _cli() -> list[str]:
    return [sys.executable, "-m", "diffusion_offload"]


def test_serve_port_in_use_and_bad_key_are_one_line_exit_2(wan_dirs: dict[str, Path]) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        runs = [
            subprocess.Popen([*_cli(), "serve", str(wan_dirs["tiny"]), "--device", "cpu", "--port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
            subprocess.Popen([*_cli(), "serve", str(wan_dirs["tiny"]), "--api-key", "clé"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
        ]
        results = [p.communicate(timeout=120) for p in runs]
    (out, err), (out2, err2) = results
    assert runs[0].returncode == 2, err
    assert err.strip().splitlines() == [
        f"diffusion-offload: error: --port {port}: address 127.0.0.1:{port} is already in use "
        "(another server?); choose another --port, or --port 0 for a free one"
    ]
    assert runs[1].returncode == 2
    lines = err2.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diffusion-offload: error: --api-key: character 3 ('é')")
