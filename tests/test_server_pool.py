"""One server, several models on one device (issue 35 items 1-3): ``serve --model`` /
``--models``, requests routed by ``model``, ``/v1/models`` with where each model's weights
are, swaps on ``/metrics``; outputs equal each model served alone."""

from __future__ import annotations

import base64
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from PIL import Image

from diffusion_offload.cli import main
from diffusion_offload.engine import ModelPool, ModelSpec, Omni, SamplingParams
from diffusion_offload.server import ServerSettings, create_app
from diffusion_offload.server.model_list import model_specs, read_models_file
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

KINDS = ("flux", "wan2.2", "wan2.2-i2v")
KEY = "sk-pool"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("server-pool")
    return {kind: tiny_pipelines.save(kind, root / kind) for kind in KINDS}


class _Server:
    def __init__(self, engine: Any, settings: ServerSettings) -> None:
        self.app = create_app(engine, settings)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn did not start"
            threading.Event().wait(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"})

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def pool_server(dirs) -> Iterator[tuple[_Server, ModelPool]]:
    fa.install()
    pool = ModelPool([ModelSpec(k, str(dirs[k])) for k in KINDS], device="fakegpu", progress=False)
    settings = ServerSettings(model_id=KINDS[0], model_ids=KINDS, api_key=KEY, max_steps=8, max_frames=9)
    server = _Server(pool, settings)
    yield server, pool
    server.stop()
    pool.close()


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _picture() -> Image.Image:
    x = np.arange(32, dtype=np.int64) * 8
    return Image.fromarray(np.stack([np.add.outer(x, x) % 256] * 3, axis=-1).astype(np.uint8))


def _image_alone(directory: Path, seed: int) -> np.ndarray:
    with Omni(str(directory), None, device="fakegpu", progress=False) as alone:
        out = alone.generate("a red car", SamplingParams(height=32, width=32, num_inference_steps=2, seed=seed))
    return np.asarray(out[0].images[0])


def _wait_video(c: httpx.Client, job: dict) -> bytes:
    for _ in range(600):
        state = c.get(f"/v1/videos/{job['id']}").json()
        if state["status"] in ("completed", "failed"):
            break
        threading.Event().wait(0.05)
    assert state["status"] == "completed", state
    return c.get(f"/v1/videos/{job['id']}/content").content


def test_requests_are_routed_by_model_and_equal_each_model_alone(pool_server, dirs, fake_device):
    server, pool = pool_server
    want = _image_alone(dirs["flux"], 5)
    with server.client() as c:
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert list(listed) == list(KINDS)
        assert {k: m["kind"] for k, m in listed.items()} == {"flux": "image", "wan2.2": "video",
                                                             "wan2.2-i2v": "video"}
        assert all(m["device_bytes"] == 0 and m["host_bytes"] > 0 for m in listed.values())  # asleep
        body = {"prompt": "a red car", "size": "32x32", "num_inference_steps": 2, "seed": 5}
        r = c.post("/v1/images/generations", json={**body, "model": "flux"})
        assert r.status_code == 200, r.text
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
        assert np.array_equal(got, want)
        # a video model for images, no model, an unknown one
        wrong = c.post("/v1/images/generations", json={**body, "model": "wan2.2"})
        assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "unsupported_model"
        missing = c.post("/v1/images/generations", json=body)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
        assert "'flux', 'wan2.2', 'wan2.2-i2v'" in missing.json()["error"]["message"]
        unknown = c.post("/v1/images/generations", json={**body, "model": "sdxl"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert "'flux', 'wan2.2', 'wan2.2-i2v'" in unknown.json()["error"]["message"]
        assert c.get("/v1/models/sdxl").status_code == 404
        # a text-to-video job and an image-to-video job, then flux again
        job = c.post("/v1/videos", json={"prompt": "a cat", "model": "wan2.2", "size": "32x32",
                                         "num_frames": 5, "num_inference_steps": 2, "seed": 1}).json()
        assert job["model"] == "wan2.2"
        assert _wait_video(c, job)[4:8] == b"ftyp"
        files = {"input_reference": ("in.png", _png(_picture()), "image/png")}
        form = {"prompt": "a cat", "model": "wan2.2-i2v", "size": "32x32", "num_frames": "5",
                "num_inference_steps": "2", "seed": "1"}
        job = c.post("/v1/videos", data=form, files=files)
        assert job.status_code == 200, job.text
        assert _wait_video(c, job.json())[4:8] == b"ftyp"
        r = c.post("/v1/images/generations", json={**body, "model": "flux"})
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
        assert np.array_equal(got, want)
        listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert {k: (m["requests"], m["swaps"]) for k, m in listed.items()} == {
            "flux": (2, 2), "wan2.2": (1, 1), "wan2.2-i2v": (1, 1)}
        assert listed["flux"]["device_bytes"] > 0 and listed["wan2.2"]["device_bytes"] == 0
        metrics = c.get("/metrics").text
    assert 'diffusion_offload_model_swaps_total{model="flux"} 2.0' in metrics
    assert 'diffusion_offload_model_swap_seconds_count{model="wan2.2-i2v"} 1.0' in metrics
    device = [line for line in metrics.splitlines()
              if line.startswith('diffusion_offload_model_bytes{model="flux",tier="device"}')]
    assert device and float(device[0].split()[-1]) == listed["flux"]["device_bytes"]
    assert all(e.stats.d2h_bytes == 0 for e in pool.engines.values())  # no weight went device-to-host
    assert fa.stats()["races_detected"] == 0


def test_the_models_file_and_repeated_model_flags(tmp_path, dirs):
    toml = tmp_path / "models.toml"
    toml.write_text(f'[[models]]\nid = "img"\npath = "{dirs["flux"]}"\n\n'
                    f'[[models]]\nid = "vid"\npath = "{dirs["wan2.2"]}"\nvariant = "fp16"\n'
                    'config = {{mode = "layer", components = ["dit"]}}\n'.replace("{{", "{").replace("}}", "}"))
    specs = read_models_file(str(toml), {"config": None, "variant": None, "dtype": None, "loras": []})
    assert [(s.id, s.variant, s.config and s.config.mode) for s in specs] == [
        ("img", None, None), ("vid", "fp16", "layer")]
    listed = tmp_path / "models.json"
    listed.write_text(json.dumps([{"id": "a", "path": "x", "colour": 1}]))
    with pytest.raises(ValueError, match="entry 0: unknown key 'colour'; allowed: id, path"):
        read_models_file(str(listed), {})
    specs = model_specs(None, ["img=" + str(dirs["flux"]), str(dirs["wan2.2"])], None, {})
    assert [s.id for s in specs] == ["img", str(dirs["wan2.2"])]
    with pytest.raises(ValueError, match="repeated: img"):
        model_specs(None, ["img=a", "img=b"], None, {})
    with pytest.raises(ValueError, match="serve needs a model"):
        model_specs(None, [], None, {})


def test_serve_refuses_a_bad_models_file_in_one_line(tmp_path, capsys):
    bad = tmp_path / "models.json"
    bad.write_text('[{"id": "a"}]')
    assert main(["serve", "--models", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"diffusion-offload: error: --models {bad}: entry 0: 'path' is required, a non-empty "
                   "string (got None)"]
    assert main(["serve", "--model", "a=/nonexistent/a", "--model", "b=/nonexistent/b", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffusion-offload: error: model 'a': ") and "\n" not in err
    assert main(["serve", "--ray", "--model", "a=x", "--model", "b=y"]) == 2
    assert "--ray serves one model" in capsys.readouterr().err


@pytest.mark.slow
def test_thirty_interleaved_sdk_requests_from_three_clients_under_a_capacity(dirs, fake_device):
    """Issue 35's check: wan2.2, wan2.2-i2v and flux behind one server, a device capacity
    that fits the largest single model's run, 30 requests from 3 concurrent clients on the
    official SDK: every output equals the model run alone, the peak stays under the
    capacity, no weight goes device-to-host, and each swap is a change of model in the
    order the jobs ran."""
    import openai

    from diffusion_offload.engine.media import encode_video

    def params(kind: str, seed: int) -> SamplingParams:
        frames = 5 if kind != "flux" else None
        return SamplingParams(height=32, width=32, num_inference_steps=2, seed=seed, num_frames=frames)

    def prompt(kind: str) -> Any:
        return {"prompt": "a cat", "image": _picture()} if kind == "wan2.2-i2v" else "a cat"

    want: dict[tuple[str, int], bytes | np.ndarray] = {}
    peaks = []
    for kind in KINDS:
        with Omni(str(dirs[kind]), None, device="fakegpu", progress=False) as alone:
            fa.reset_stats()
            for seed in (1, 2):
                out = alone.generate(prompt(kind), params(kind, seed))[0]
                want[kind, seed] = (np.asarray(out.images[0]) if kind == "flux"
                                    else encode_video(out.frames[0], 16, ".mp4"))
            peaks.append(fa.stats()["peak_bytes"])
    capacity = max(peaks)  # all-resident: the pool's offload needs less than any model alone
    pool = ModelPool([ModelSpec(k, str(dirs[k])) for k in KINDS], device="fakegpu", progress=False)
    ran: list[str] = []  # the order the jobs ran in
    original = pool.generate

    def recording(model: str, *args: Any, **kwargs: Any) -> Any:
        ran.append(model)
        return original(model, *args, **kwargs)

    pool.generate = recording  # type: ignore[method-assign]
    seen: list[str] = []
    pool.listeners.append(lambda model, seconds: seen.append(model))
    settings = ServerSettings(model_id=KINDS[0], model_ids=KINDS, api_key=KEY, max_steps=8, max_frames=9,
                              max_queue=64)
    server = _Server(pool, settings)
    fa.reset_stats()
    fa.set_capacity(capacity)
    errors: list[BaseException] = []

    def client_loop(offset: int) -> None:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
        try:
            for i in range(10):
                kind = KINDS[(offset + i) % 3]
                seed = 1 + (offset + i) % 2
                extra = {"num_inference_steps": 2, "seed": seed}
                if kind == "flux":
                    r = client.images.generate(model=kind, prompt="a cat", size="32x32", extra_body=extra)
                    got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))))
                    assert np.array_equal(got, want[kind, seed]), (kind, seed)
                    continue
                ref = {"input_reference": ("in.png", _png(_picture()), "image/png")} if kind != "wan2.2" else {}
                job = client.videos.create(model=kind, prompt="a cat", size="32x32",
                                           extra_body={**extra, "num_frames": 5}, **ref)
                with server.client() as c:
                    assert _wait_video(c, job.model_dump()) == want[kind, seed], (kind, seed)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        assert not errors, errors[0]
        assert len(ran) == 30
        assert fa.stats()["peak_bytes"] <= capacity
        assert all(e.stats.d2h_bytes == 0 for e in pool.engines.values())
        assert seen == [k for i, k in enumerate(ran) if i == 0 or ran[i - 1] != k]
    finally:
        fa.set_capacity(None)
        server.stop()
        pool.close()


def test_release_on_demand_and_after_idle(pool_server, dirs, fake_device):
    server, pool = pool_server
    body = {"prompt": "a red car", "size": "32x32", "num_inference_steps": 2, "seed": 5, "model": "flux"}
    with server.client() as c:
        assert c.post("/v1/images/generations", json=body).status_code == 200
        assert pool.engines["flux"].backend.device_weight_bytes() > 0
        r = c.post("/v1/models/flux/release")
        assert r.status_code == 200 and r.json()["released_bytes"] > 0
        assert all(e.backend.device_weight_bytes() == 0 for e in pool.engines.values())
        assert c.post("/v1/models/flux/release").json()["released_bytes"] == 0
        assert c.post("/v1/models/sdxl/release").status_code == 404
        assert httpx.post(f"{server.url}/v1/models/flux/release").status_code == 401  # the API key
    # one model, built sleepable by --idle-release: evicted once idle, the next output equal
    want = _image_alone(dirs["flux"], 5)
    engine = Omni(str(dirs["flux"]), {"mode": "module", "components": ["dit", "text_encoder"]},
                  device="fakegpu", progress=False, sleepable=True)
    single = _Server(engine, ServerSettings(model_id="tiny", api_key=KEY, idle_release=0.2))
    try:
        with single.client() as c:
            body["model"] = "tiny"
            for _ in range(2):
                r = c.post("/v1/images/generations", json=body)
                got = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
                assert np.array_equal(got, want)
                for _ in range(100):  # the idle thread polls every 50 ms
                    if engine.asleep:
                        break
                    threading.Event().wait(0.05)
                assert engine.asleep and engine.backend.device_weight_bytes() == 0
            assert engine.stats.d2h_bytes == 0
    finally:
        single.stop()
        engine.close()
    plain = Omni(str(dirs["flux"]), {"mode": "module", "components": ["dit"]}, device="fakegpu", progress=False)
    server2 = _Server(plain, ServerSettings(model_id="tiny", api_key=KEY))
    try:
        with server2.client() as c:
            r = c.post("/v1/models/tiny/release")
            assert r.status_code == 409 and r.json()["error"]["code"] == "not_sleepable"
    finally:
        server2.stop()
        plain.close()


def test_idle_release_must_be_positive():
    with pytest.raises(ValueError, match="--idle-release must be a number of seconds > 0"):
        ServerSettings(model_id="x", idle_release=0)
