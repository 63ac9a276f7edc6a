"""Issue 24 items 1, 2 and 4 against real uvicorn servers on loopback: the SDK's optional
image fields (with the official ``openai`` client), every pipeline knob, per-request
``flow_shift``/``boundary_ratio``, and the default limits.

One server per model for the module, each over a tiny random pipeline on the CPU:
FLUX (images), Wan2.2 with its two experts (videos), Wan2.1 (one expert).
"""

from __future__ import annotations

import base64
import io
import os
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

from diffusion_offload.engine import Omni  # noqa: E402
from diffusion_offload.server import ServerSettings, create_app  # noqa: E402
from diffusion_offload.server.schemas import ImageGenerationRequest, Limits, check_limits  # noqa: E402
from diffusion_offload.server.state import default_max_frames  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

KEY = "sk-test"
IMG = "/v1/images/generations"


class Server:
    """``create_app`` over an engine on uvicorn in a thread, on a free loopback port."""

    def __init__(self, engine: Any, **settings: Any) -> None:
        self.app = create_app(engine, ServerSettings(model_id="tiny", api_key=KEY, max_steps=8,
                                                     **settings))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        self.engine = engine

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"})

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("knobs")
    return {kind: tiny_pipelines.save(kind, root / kind) for kind in ("flux", "wan2.2", "wan2.1")}


@pytest.fixture(scope="module")
def flux(models: dict[str, Path]) -> Iterator[Server]:
    server = Server(Omni(str(models["flux"]), device="cpu", progress=False))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def wan22(models: dict[str, Path]) -> Iterator[Server]:
    server = Server(Omni(str(models["wan2.2"]), device="cpu", progress=False), max_frames=9)
    yield server
    server.stop()


def body(seed: int = 1, **extra: Any) -> dict[str, Any]:
    return {"prompt": "a red car", "size": "16x16", "num_inference_steps": 1, "seed": seed, **extra}


def png(c: httpx.Client, **fields: Any) -> bytes:
    r = c.post(IMG, json=body(**fields))
    assert r.status_code == 200, r.text
    return base64.b64decode(r.json()["data"][0]["b64_json"])


def error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def video(c: httpx.Client, **fields: Any) -> bytes:
    """The mp4 bytes of a cheap Wan2.2 job (2 steps: one on each expert)."""
    fields = {"prompt": "a cat", "size": "32x32", "num_frames": 5, "num_inference_steps": 2,
              "seed": 4, **fields}
    r = c.post("/v1/videos", json=fields)
    assert r.status_code == 200, r.text
    job = r.json()
    deadline = time.monotonic() + 60
    while job["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
        job = c.get(f"/v1/videos/{job['id']}").json()
    assert job["status"] == "completed", job
    return c.get(f"/v1/videos/{job['id']}/content").content


# ---------------------------------------------------------------------- item 2: SDK fields


def test_openai_images_generate_with_every_optional_field_and_with_nulls(flux: Server) -> None:
    import openai

    with flux.client() as c:
        plain = png(c)
        client = openai.OpenAI(base_url=f"{flux.url}/v1", api_key=KEY, max_retries=0)
        result = client.images.generate(
            model="tiny", prompt="a red car", size="16x16", n=1, quality="auto", style="vivid",
            background="opaque", output_format="png", moderation="auto", user="someone",
            safety_identifier="user-1", partial_images=0, response_format="b64_json",
            extra_body={"seed": 1, "num_inference_steps": 1})
        (item,) = result.data
        assert base64.b64decode(item.b64_json) == plain  # accepted, and the output unchanged
        assert item.revised_prompt is None and item.url is None
        raw = c.post(IMG, json=body()).json()["data"][0]
        assert raw["revised_prompt"] is None and raw["url"] is None and "b64_json" in raw
        nulls = {k: None for k in ("model", "n", "response_format", "quality", "style",
                                   "background", "output_format", "output_compression",
                                   "moderation", "safety_identifier", "user", "partial_images",
                                   "stream", "negative_prompt", "guidance_scale", "width",
                                   "height", "flow_shift", "extra_params", "true_cfg_scale")}
        assert png(c, **nulls) == plain  # null means not given, knobs included
        # OpenAI's prompt limit: 32,000 characters (the tokenizer truncates it)
        assert c.post(IMG, json=body(prompt="car " * 8000)).status_code == 200


def test_output_format_compression_file_and_the_refused_fields(flux: Server) -> None:
    with flux.client() as c:
        plain = png(c)
        sizes = {}
        for fmt, compression in (("jpeg", 10), ("jpeg", 95), ("webp", 10), ("webp", 95)):
            r = c.post(IMG, json=body(output_format=fmt, output_compression=compression))
            assert r.status_code == 200 and r.json()["output_format"] == fmt
            data = base64.b64decode(r.json()["data"][0]["b64_json"])
            image = Image.open(io.BytesIO(data))
            assert image.format == fmt.upper() and image.size == (16, 16)
            sizes[fmt, compression] = len(data)
        assert sizes["jpeg", 10] < sizes["jpeg", 95] and sizes["webp", 10] < sizes["webp", 95]
        r = c.post(IMG, json=body(response_format="file"))
        assert r.headers["content-type"] == "image/png" and r.content == plain
        r = c.post(IMG, json=body(response_format="file", output_format="webp"))
        assert r.headers["content-type"] == "image/webp" and r.content.startswith(b"RIFF")
        r = c.post(IMG, json=body(response_format="url", output_format="jpeg"))
        url = r.json()["data"][0]["url"]
        assert url.endswith("/0.jpeg") and c.get(url).headers["content-type"] == "image/jpeg"
        err = error(c.post(IMG, json=body(background="transparent")))
        assert err["param"] == "background" and "opaque images" in err["message"]
        err = error(c.post(IMG, json=body(stream=True)))
        assert err["param"] == "stream" and "streaming is not supported" in err["message"]
        assert error(c.post(IMG, json=body(partial_images=2)))["param"] == "partial_images"
        assert error(c.post(IMG, json=body(quality="ultra")))["param"] == "quality"
        assert error(c.post(IMG, json=body(output_compression=101)))["param"] == "output_compression"
        err = error(c.post(IMG, json=body(response_format="file", n=2)))
        assert "one image" in err["message"]


# ---------------------------------------------------------------------- item 1: knobs


def test_negative_prompt_is_never_ignored_on_flux(flux: Server) -> None:
    with flux.client() as c:
        plain = png(c)
        negative = png(c, negative_prompt="blurry")
        assert negative != plain  # true_cfg_scale defaults to 4.0 with a negative prompt
        assert png(c, negative_prompt="blurry", true_cfg_scale=4.0) == negative
        assert png(c, negative_prompt="blurry", extra_params={"true_cfg_scale": 4.0}) == negative
        assert png(c, negative_prompt="blurry", true_cfg_scale=6.0) != negative
        assert png(c, true_cfg_scale=4.0) == plain  # no negative prompt: no true CFG
        err = error(c.post(IMG, json=body(negative_prompt="blurry", true_cfg_scale=1.0)))
        assert err["param"] == "true_cfg_scale"
        assert "'negative_prompt' needs 'true_cfg_scale' > 1" in err["message"]


def test_knobs_typed_bounded_and_refused_by_name(flux: Server) -> None:
    with flux.client() as c:
        plain = png(c)
        assert png(c, max_sequence_length=64) != plain  # a knob reaches the pipeline
        assert png(c, max_sequence_length=512) == plain  # the pipeline's default
        for field in ("output_type", "return_dict", "generator", "num_images_per_prompt",
                      "latents", "prompt_embeds", "callback_on_step_end"):
            err = error(c.post(IMG, json=body(**{field: 1})))
            assert err["param"] == field and f"'{field}' cannot be set by a request" in err["message"]
        assert "use 'n'" in error(c.post(IMG, json=body(num_images_per_prompt=2)))["message"]
        err = error(c.post(IMG, json=body(extra_params={"latents": [1.0]})))
        assert err["param"] == "extra_params.latents"
        err = error(c.post(IMG, json=body(colour="red")))
        assert err["param"] == "colour" and err["code"] == "unknown_parameter"
        assert "This model takes:" in err["message"] and "true_cfg_scale" in err["message"]
        assert "max_sequence_length" in err["message"] and "output_format" in err["message"]
        err = error(c.post(IMG, json=body(true_cfg_scale="high")))
        assert err["param"] == "true_cfg_scale" and "expected a number" in err["message"]
        assert error(c.post(IMG, json=body(true_cfg_scale=1e9)))["param"] == "true_cfg_scale"
        assert error(c.post(IMG, json=body(max_sequence_length=1.5)))["param"] == "max_sequence_length"
        err = error(c.post(IMG, json=body(sigmas=[1.0] * 10)))  # --max-steps 8: 9 items at most
        assert err["param"] == "sigmas" and "1 to 9 items" in err["message"]
        assert error(c.post(IMG, json=body(sigmas="1.0")))["param"] == "sigmas"
        err = error(c.post(IMG, json=body(true_cfg_scale=2.0, extra_params={"true_cfg_scale": 3.0})))
        assert "given twice" in err["message"]
        # the pipeline's own check_inputs, at creation, with its message
        err = error(c.post(IMG, json=body(max_sequence_length=600)))
        assert "`max_sequence_length` cannot be greater than 512" in err["message"]
        err = error(c.post(IMG, json=body(flow_shift=3.0)))  # FLUX shifts by the image size
        assert err["param"] == "flow_shift" and "dynamic shifting" in err["message"]
        assert error(c.post(IMG, json=body(boundary_ratio=0.5)))["param"] == "boundary_ratio"


def test_width_and_height_instead_of_size(flux: Server) -> None:
    with flux.client() as c:
        assert png(c, size=None, width=16, height=16) == png(c)
        image = Image.open(io.BytesIO(png(c, size=None, width=32, height=16)))
        assert image.size == (32, 16)
        err = error(c.post(IMG, json=body(size="32x32", width=16, height=16)))
        assert "disagrees" in err["message"]
        assert error(c.post(IMG, json=body(size=None, width=17, height=16)))["param"] == "width"


def test_flow_shift_and_boundary_ratio_hold_for_one_request(wan22: Server) -> None:
    pipe = wan22.engine.pipeline
    own_shift, own_ratio = pipe.scheduler.config.flow_shift, pipe.config.boundary_ratio
    with wan22.client() as c:
        plain = video(c)
        shifted = video(c, flow_shift=9.0)
        assert shifted != plain
        assert video(c) == plain  # the next request gets the model's own shift
        switched = video(c, boundary_ratio=0.1)  # both steps on the high-noise expert
        assert switched != plain
        assert video(c, extra_params={"max_sequence_length": 8}) != plain
        assert (pipe.scheduler.config.flow_shift, pipe.config.boundary_ratio) == (own_shift, own_ratio)

        async def together() -> list[bytes]:  # two at once never see each other's values
            import asyncio

            return await asyncio.gather(asyncio.to_thread(video, c, flow_shift=9.0),
                                        asyncio.to_thread(video, c, boundary_ratio=0.1))

        import asyncio

        assert asyncio.run(together()) == [shifted, switched]
        assert error(c.post("/v1/videos", json={"prompt": "a", "boundary_ratio": 2}))["param"] == \
            "boundary_ratio"


def test_guidance_scale_2_on_one_expert_is_a_400_at_creation(models: dict[str, Path]) -> None:
    server = Server(Omni(str(models["wan2.1"]), device="cpu", progress=False))
    try:
        with server.client() as c:
            r = c.post("/v1/videos", json={"prompt": "a cat", "guidance_scale_2": 3.0})
            err = error(r)
            assert "`guidance_scale_2` is only supported when" in err["message"]
            err = error(c.post("/v1/videos", json={"prompt": "a cat", "boundary_ratio": 0.5}))
            assert err["param"] == "boundary_ratio" and "has one" in err["message"]
            assert server.app.state.server.jobs.list() == []
    finally:
        server.stop()


# ---------------------------------------------------------------------- item 4: forms, limits


def test_vllm_omni_form_quick_start_and_url_encoded_forms(wan22: Server) -> None:
    with wan22.client() as c:
        fields = {"prompt": "a cat", "width": "32", "height": "32", "num_frames": "5",
                  "fps": "16", "num_inference_steps": "2", "seed": "4", "flow_shift": "9.0",
                  "guidance_scale_2": "3.0"}
        multipart = c.post("/v1/videos", files={k: (None, v) for k, v in fields.items()})
        assert multipart.status_code == 200, multipart.text
        assert multipart.json()["size"] == "32x32" and multipart.json()["num_frames"] == 5
        encoded = c.post("/v1/videos", data=fields)  # application/x-www-form-urlencoded
        assert encoded.status_code == 200, encoded.text
        r = c.post("/v1/videos", data={**fields, "extra_params": '{"max_sequence_length": 16}'})
        assert r.status_code == 200, r.text
        assert error(c.post("/v1/videos", data={**fields, "num_frames": "6"}))["param"] == "num_frames"
        assert error(c.post("/v1/videos", data={**fields, "extra_params": "[1]"}))["param"] == \
            "extra_params"
        assert error(c.post("/v1/videos", data={**fields, "latents": "1"}))["param"] == "latents"
        job = c.post("/v1/videos", json={"prompt": "a", "seconds": "4", "fps": 2}).json()
        assert (job["seconds"], job["num_frames"]) == ("4", 9)  # echoed as given
        for made in (multipart, encoded, r):
            c.delete(f"/v1/videos/{made.json()['id']}")
        c.delete(f"/v1/videos/{job['id']}")


def test_default_limits_admit_openai_sizes_and_12_seconds() -> None:
    settings = ServerSettings(model_id="m")
    limits = Limits(settings.max_pixels, default_max_frames(settings, 4), settings.max_steps)
    for size in ("1024x1024", "1536x1024", "1024x1536", "1792x1024", "1024x1792"):
        check_limits(ImageGenerationRequest(prompt="a", size=size), limits)
    with pytest.raises(Exception, match="2048x2048 = 4194304 pixels is over this server's limit"):
        check_limits(ImageGenerationRequest(prompt="a", size="2048x2048"), limits)
    assert settings.max_pixels == 2_097_152
    assert limits.max_frames == 193  # 12 s at 16 fps, 4k+1
    from diffusion_offload.models.rules import frames_for_seconds

    assert frames_for_seconds(12, 16, 4) == 193
    assert default_max_frames(ServerSettings(model_id="m", max_frames=9), 4) == 9


def test_input_reference_on_a_text_to_video_model_gives_the_reason(wan22: Server) -> None:
    import openai

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(buf, format="PNG")
    client = openai.OpenAI(base_url=f"{wan22.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.videos.create(model="tiny", prompt="a cat", size="32x32",
                             input_reference=("ref.png", buf.getvalue(), "image/png"))
    body = err.value.body
    assert body["param"] == "input_reference"
    assert "makes videos from text only" in body["message"] and "WanImageToVideoPipeline" in body["message"]
