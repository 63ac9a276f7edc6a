"""Issue 24 item 3, image-to-video: ``make-tiny wan2.2-i2v`` (a tiny
``WanImageToVideoPipeline`` with two experts, laid out like Wan2.2-I2V-A14B), ``Omni`` and
``generate --image`` on it, and ``input_reference`` on ``POST /v1/videos`` with the
official ``openai`` client over real uvicorn on loopback."""

from __future__ import annotations

import gc
import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

from diffusion_offload.cli import main  # noqa: E402
from diffusion_offload.engine import Omni, SamplingParams  # noqa: E402
from diffusion_offload.engine.media import encode_video  # noqa: E402
from diffusion_offload.testing import fake_accelerator as fa  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402
from diffusion_offload.testing.pytest_plugin import requires_fake  # noqa: E402
from test_server_knobs import KEY, Server, error  # noqa: E402

KIND = "wan2.2-i2v"
PROMPT = "a cat"


def reference_image() -> Image.Image:
    return tiny_pipelines.default_call_kwargs(KIND)["image"]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def params(seed: int = 4) -> SamplingParams:
    """The tiny call (32x32, 5 frames, 2 steps: one on each expert) as ``SamplingParams``."""
    kw = tiny_pipelines.default_call_kwargs(KIND)
    return SamplingParams(height=kw["height"], width=kw["width"], num_frames=kw["num_frames"],
                          num_inference_steps=kw["num_inference_steps"], seed=seed)


def frames(engine: Omni, image: Image.Image, seed: int = 4) -> np.ndarray:
    out = engine.generate({"prompt": PROMPT, "image": image}, params(seed))[0]
    return np.stack([np.asarray(f) for f in out.frames[0]])


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipelines.save(KIND, tmp_path_factory.mktemp("i2v") / "i2v")


@pytest.fixture(scope="module")
def i2v(i2v_dir: Path) -> Iterator[Server]:
    server = Server(Omni(str(i2v_dir), device="cpu", progress=False), max_frames=9)
    yield server
    server.stop()


def test_make_tiny_i2v_is_wan22_i2v_a14b_laid_out(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "tiny-i2v"
    assert main(["make-tiny", KIND, str(target)]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    index = json.loads((target / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == [None, None] and index["image_processor"] == [None, None]
    assert (index["boundary_ratio"], index["expand_timesteps"]) == (0.875, False)
    for name in ("transformer", "transformer_2"):
        config = json.loads((target / name / "config.json").read_text())
        assert (config["in_channels"], config["out_channels"], config["image_dim"]) == (36, 16, None)
    assert tiny_pipelines.read_marker(target) == {"kind": KIND, "seed": 0, "num_layers": None}
    # loaded back by path as every kind is, with the same weights as build()
    built = tiny_pipelines.build(KIND)
    with Omni(str(target), device="cpu", progress=False) as engine:
        pipe = engine.pipeline
        assert type(pipe).__name__ == "WanImageToVideoPipeline"
        assert pipe.image_encoder is None and pipe.transformer_2 is not None
        for name in ("transformer", "transformer_2", "vae", "text_encoder"):
            a, b = getattr(pipe, name).state_dict(), getattr(built, name).state_dict()
            assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), name
        assert not np.array_equal(pipe.transformer.proj_out.weight.detach(),
                                  pipe.transformer_2.proj_out.weight.detach())  # two experts


@requires_fake
def test_i2v_under_module_and_layer_offload_equals_resident(i2v_dir: Path, fake_device) -> None:
    image = reference_image()
    gc.collect()
    baseline = fa.stats()["allocated_bytes"]
    runs: dict[str, np.ndarray] = {}
    ran: dict[str, set[str]] = {}
    for name, config in (("resident", None),
                         ("module", {"mode": "module", "components": ["dit", "text_encoder"]}),
                         ("layer", {"mode": "layer", "components": ["dit"]})):
        with Omni(str(i2v_dir), config, device="fakegpu", progress=False) as engine:
            pipe = engine.pipeline
            s = engine.stats  # host copies: the check buffers a request makes are apart
            host = (s.pinned_bytes, s.pageable_host_bytes)
            seen: set[str] = set()
            hooks = [getattr(pipe, n).register_forward_pre_hook(lambda *_a, n=n: seen.add(n))
                     for n in ("transformer", "transformer_2")]
            runs[name] = frames(engine, image)
            for h in hooks:
                h.remove()
            ran[name] = seen
            del pipe
            if engine.backend is not None:
                assert engine.backend.audit() == []
                assert engine.stats.h2d_bytes > 0
                assert (s.pinned_bytes, s.pageable_host_bytes) == host
    assert runs["resident"].shape == (5, 32, 32, 3)
    assert np.array_equal(runs["module"], runs["resident"])
    assert np.array_equal(runs["layer"], runs["resident"])
    assert all(s == {"transformer", "transformer_2"} for s in ran.values())  # both experts ran
    gc.collect()
    assert fa.stats()["allocated_bytes"] == baseline  # closed engines leave nothing behind


def test_the_image_conditions_the_video_and_text_only_is_refused(i2v: Server) -> None:
    engine = i2v.engine
    a = frames(engine, reference_image())
    b = frames(engine, Image.new("RGB", (32, 32), (250, 10, 10)))
    assert a.shape == b.shape == (5, 32, 32, 3) and not np.array_equal(a, b)
    from diffusion_offload.engine.knobs import KnobError

    with pytest.raises(KnobError, match="makes its output from an input image") as err:
        engine.generate(PROMPT, params())
    assert err.value.field == "image"


def test_generate_image_writes_the_engines_video(i2v_dir: Path, i2v: Server, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "ref.png").write_bytes(png(reference_image()))
    out = tmp_path / "out.mp4"
    assert main(["generate", "--model", str(i2v_dir), "--device", "cpu", "--prompt", PROMPT,
                 "--image", str(tmp_path / "ref.png"), "--seed", "4", "--output", str(out)]) == 0
    result = i2v.engine.generate({"prompt": PROMPT, "image": reference_image()}, params())[0]
    assert out.read_bytes() == encode_video(result.frames[0], 16, ".mp4")
    capsys.readouterr()
    assert main(["generate", "--model", str(i2v_dir), "--device", "cpu", "--prompt", PROMPT,
                 "--output", str(tmp_path / "none.mp4")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "WanImageToVideoPipeline makes its output from an input image" in err[0]
    assert not (tmp_path / "none.mp4").exists()


def _wait(c, job: dict) -> dict:
    deadline = time.monotonic() + 60
    while job["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        job = c.get(f"/v1/videos/{job['id']}").json()
    return job


def test_openai_videos_create_with_input_reference(i2v: Server) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{i2v.url}/v1", api_key=KEY, max_retries=0)
    job = client.videos.create(model="tiny", prompt=PROMPT, size="32x32",
                               input_reference=("ref.png", png(reference_image()), "image/png"),
                               extra_body={"num_frames": 5, "num_inference_steps": 2, "seed": 4})
    with i2v.client() as c:
        done = _wait(c, job.model_dump())
        assert done["status"] == "completed", done
        content = c.get(f"/v1/videos/{job.id}/content")
        assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
        c.delete(f"/v1/videos/{job.id}")
    result = i2v.engine.generate({"prompt": PROMPT, "image": reference_image()}, params())[0]
    assert content.content == encode_video(result.frames[0], 16, ".mp4")


def test_input_reference_is_checked_and_named(i2v: Server) -> None:
    fields = {"prompt": PROMPT, "size": "32x32", "num_frames": "5", "num_inference_steps": "2"}
    with i2v.client() as c:
        def post(files: dict):
            return c.post("/v1/videos", data=fields, files=files)

        err = error(post({"input_reference": ("a.txt", b"not an image", "text/plain")}))
        assert err["param"] == "input_reference" and "not a PNG, JPEG or WebP" in err["message"]
        err = error(post({"input_reference": ("big.png", png(Image.new("RGB", (4000, 4000))))}))
        assert err["param"] == "input_reference" and "4000x4000 = 16000000 pixels" in err["message"]
        two = [("input_reference", ("a.png", png(reference_image()))),
               ("input_reference", ("b.png", png(reference_image())))]
        err = error(c.post("/v1/videos", data=fields, files=two))
        assert err["param"] == "input_reference" and "give one image" in err["message"]
        # an image-to-video model needs the image
        err = error(c.post("/v1/videos", json={"prompt": PROMPT, "size": "32x32"}))
        assert err["param"] == "input_reference"
        assert "WanImageToVideoPipeline makes videos from an image" in err["message"]
        assert c.get("/v1/videos").json()["data"] == []  # nothing was queued


class RemoteLike:
    """The engine as ``serve --ray``'s ingress sees it (``ray_serve.ingress._RemoteEngine``:
    ``is_video``, ``image_input``, ``pipeline_class``; no local pipeline, no
    ``check_request``), running its jobs on a real engine as a generator replica would."""

    def __init__(self, engine: Omni) -> None:
        self.is_video = True
        self.image_input = engine.image_input
        self.pipeline_class = engine.pipeline_class
        self._engine = engine

    def generate(self, prompts, params):
        return self._engine.generate(prompts, params)


def test_input_reference_needs_only_what_a_remote_engine_reports(i2v: Server) -> None:
    assert (i2v.engine.image_input, i2v.engine.pipeline_class) == ("required", "WanImageToVideoPipeline")
    remote = Server(RemoteLike(i2v.engine), max_frames=9)
    fields = {"prompt": PROMPT, "size": "32x32", "num_frames": "5", "num_inference_steps": "2",
              "seed": "4"}
    try:
        with remote.client() as c:
            r = c.post("/v1/videos", data=fields,
                       files={"input_reference": ("ref.png", png(reference_image()), "image/png")})
            assert r.status_code == 200, r.text
            job = _wait(c, r.json())
            assert job["status"] == "completed", job
            content = c.get(f"/v1/videos/{job['id']}/content").content
            err = error(c.post("/v1/videos", data=fields))
            assert err["param"] == "input_reference"
            assert "WanImageToVideoPipeline makes videos from an image" in err["message"]
    finally:
        remote.stop()
    result = i2v.engine.generate({"prompt": PROMPT, "image": reference_image()}, params())[0]
    assert content == encode_video(result.frames[0], 16, ".mp4")
