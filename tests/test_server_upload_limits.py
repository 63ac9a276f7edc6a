"""Issue 38 item 5b: uploads bounded per request (the count of images and their pixels in
all, read from the headers before anything is decoded) and decoded off the event loop;
a header past Pillow's decompression-bomb limit a 400 naming the field on every upload
route; every steps knob under ``--max-steps``; a finished ``input_reference`` job keeps
no image.

The servers run over engine doubles (what the routes need of an engine, and a
``generate`` that records what it was given), so the limits are tested without a model.
"""

from __future__ import annotations

import base64
import io
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from diffusion_offload.engine.knobs import Knob, check_knob, is_steps_knob, knob_table  # noqa: E402
from diffusion_offload.engine.params import GenerationOutput  # noqa: E402
from diffusion_offload.server import ServerSettings, create_app  # noqa: E402
from diffusion_offload.server import uploads  # noqa: E402
from diffusion_offload.server.errors import APIError  # noqa: E402
from diffusion_offload.server.schemas import ImageGenerationRequest, Limits, pipeline_kwargs  # noqa: E402
from test_server_knobs import Server  # noqa: E402

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
EDITS = "/v1/images/edits"
MAX_PIXELS = 64 * 64


def png(size: tuple[int, int] = (8, 8), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, format="PNG")
    return buf.getvalue()


def bomb_png(width: int = 20_000, height: int = 20_000) -> bytes:
    """A 57-byte PNG whose header claims ``width x height`` (400 MP: over twice Pillow's
    default limit of 89,478,485 pixels, so ``Image.open`` raises on the header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


class Editor:
    """An image model with an image-to-image variant; records the prompts it generates."""

    is_video = False
    pipeline_class = "EditorDouble"

    def __init__(self, knobs: dict[str, Knob] | None = None) -> None:
        self.knobs = knobs or {}
        self.prompts: list[Any] = []

    def knobs_for(self, mask: bool) -> tuple[dict, dict]:
        return self.knobs, {}

    def generate(self, prompts: Any, params: Any) -> list[GenerationOutput]:
        self.prompts.append(prompts)
        size = (params.width or 16, params.height or 16)
        return [GenerationOutput(prompt="x", images=[Image.new("RGB", size, (200, 30, 30))])]


class ImageToVideo:
    """An image-to-video model (its pipeline requires ``image``), 3 frames a video."""

    is_video = True
    image_input = "required"
    pipeline_class = "I2VDouble"

    def __init__(self) -> None:
        self.prompts: list[Any] = []

    def generate(self, prompts: Any, params: Any) -> list[GenerationOutput]:
        self.prompts.append(prompts)
        if "FAIL" in prompts["prompt"]:
            raise RuntimeError("injected")
        frames = [Image.new("RGB", (16, 16), (i * 60, 0, 0)) for i in range(3)]
        return [GenerationOutput(prompt="x", frames=[frames])]


def settings(**extra: Any) -> ServerSettings:
    return ServerSettings(model_id="tiny", api_key=KEY, max_steps=8, max_pixels=MAX_PIXELS, **extra)


@pytest.fixture
def editor() -> Iterator[tuple[Editor, TestClient]]:
    engine = Editor()
    with TestClient(create_app(engine, settings()), base_url="http://127.0.0.1", headers=AUTH) as client:
        yield engine, client


def error(r: Any) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    return r.json()["error"]


def edit(client: TestClient, images: list[bytes], mask: bytes | None = None) -> Any:
    files = [("image", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    return client.post(EDITS, data={"prompt": "make it red", "seed": "1"}, files=files)


# ---------------------------------------------------------------------- count and pixels


def test_an_edit_takes_at_most_16_images_counted_before_decoding(
        editor: tuple[Editor, TestClient], monkeypatch: pytest.MonkeyPatch) -> None:
    engine, client = editor
    r = edit(client, [png()] * 16)
    assert r.status_code == 200, r.text
    assert len(engine.prompts[-1]["image"]) == 16  # all 16 decoded and handed on
    assert all(isinstance(i, Image.Image) and i.size == (8, 8) for i in engine.prompts[-1]["image"])
    opened: list[str] = []
    real_open = uploads._open
    monkeypatch.setattr(uploads, "_open", lambda u, *a: opened.append(u.field) or real_open(u, *a))
    err = error(edit(client, [png()] * 17))
    assert err["param"] == "image" and err["code"] == "invalid_value"
    assert err["message"] == ("Invalid value for 'image': 17 images is more than this server "
                              "takes in one request (at most 16).")
    err = error(edit(client, [png()] * 40))  # past the form's own file cap
    assert err["param"] == "image"
    assert "more than 17 files" in err["message"] and "at most 16 images" in err["message"]
    assert opened == []  # refused before any header was read


def test_the_images_of_a_request_are_bounded_in_pixels_in_all(
        editor: tuple[Editor, TestClient], monkeypatch: pytest.MonkeyPatch) -> None:
    engine, client = editor
    limit = uploads.TOTAL_PIXELS_FACTOR * MAX_PIXELS  # 16384
    full = png((64, 64))
    assert edit(client, [full] * 4).status_code == 200  # 4 x 4096 = the limit exactly
    decoded: list[str] = []
    real_decode = uploads._decode
    monkeypatch.setattr(uploads, "_decode", lambda f, i, m: decoded.append(f) or real_decode(f, i, m))
    err = error(edit(client, [full] * 5))
    assert err["param"] == "image" and err["code"] == "invalid_value"
    assert err["message"] == (f"Invalid value for 'image': the 5 images up to this one hold 20480 "
                              f"pixels in all, over this server's limit of {limit} pixels per "
                              "request (4 x --max-pixels).")
    err = error(edit(client, [full] * 4, mask=png((64, 64), "L")))
    assert err["param"] == "mask" and "20480 pixels in all" in err["message"]
    assert decoded == []  # the headers said it: nothing was decoded
    err = error(edit(client, [png((65, 64))]))  # one image over --max-pixels, as before
    assert err["param"] == "image" and "65x64 = 4160 pixels is over this server's limit of 4096" in err["message"]


def test_a_chat_message_takes_at_most_16_image_parts(editor: tuple[Editor, TestClient]) -> None:
    engine, client = editor
    url = "data:image/png;base64," + base64.b64encode(png()).decode()

    def chat(n: int) -> Any:
        parts = [{"type": "text", "text": "make it red"}]
        parts += [{"type": "image_url", "image_url": {"url": url}}] * n
        return client.post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": parts}], "seed": 1})

    r = chat(16)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"][0]["type"] == "image_url"
    assert len(engine.prompts[-1]["image"]) == 16
    err = error(chat(17))
    assert err["param"] == "messages[0].content"
    assert err["message"] == ("Invalid value for 'messages[0].content': 17 image parts is more "
                              "than this server takes in one request (at most 16).")


def test_uploads_are_decoded_off_the_event_loop_and_health_answers_meanwhile(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode held open until ``/health`` has answered: it could not answer if the
    decode ran on the event loop."""
    import httpx

    entered, release = threading.Event(), threading.Event()
    on_loop: list[bool] = []
    real_decode = uploads._decode

    def held(field: str, image: Any, mode: str) -> Any:
        import asyncio

        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        entered.set()
        release.wait(10)
        return real_decode(field, image, mode)

    monkeypatch.setattr(uploads, "_decode", held)
    server = Server(Editor(), max_pixels=MAX_PIXELS)
    try:
        with ThreadPoolExecutor(1) as pool, server.client() as client:
            pending = pool.submit(edit, client, [png()])
            assert entered.wait(10)
            start = time.monotonic()
            health = httpx.get(f"{server.url}/health", timeout=5)
            waited = time.monotonic() - start
            release.set()
            result = pending.result(timeout=30)
    finally:
        release.set()
        server.stop()
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert waited < 2.0, waited
    assert result.status_code == 200, result.text
    assert on_loop == [False]


# ---------------------------------------------------------------------- bomb headers


def test_a_bomb_header_is_a_400_naming_the_field_on_every_upload_route(
        editor: tuple[Editor, TestClient]) -> None:
    bomb = bomb_png()
    assert len(bomb) < 100
    with pytest.raises(APIError) as raised:
        uploads.decode_upload("image", bomb, max_pixels=MAX_PIXELS)
    assert raised.value.status == 400 and raised.value.param == "image"
    engine, client = editor
    err = error(edit(client, [bomb]))
    assert err["param"] == "image" and "decompression-bomb limit" in err["message"]
    assert f"at most {MAX_PIXELS} pixels (--max-pixels)" in err["message"]
    err = error(edit(client, [png((16, 16))], mask=bomb))
    assert err["param"] == "mask" and "decompression-bomb limit" in err["message"]
    url = "data:image/png;base64," + base64.b64encode(bomb).decode()
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]}]})
    err = error(r)
    assert err["param"] == "messages[0].content[1]" and "decompression-bomb" in err["message"]
    assert engine.prompts == []  # nothing reached the model
    i2v = ImageToVideo()
    with TestClient(create_app(i2v, settings(max_frames=9)), base_url="http://127.0.0.1",
                    headers=AUTH) as videos:
        r = videos.post("/v1/videos", data={"prompt": "a cat", "size": "16x16"},
                        files={"input_reference": ("ref.png", bomb, "image/png")})
        err = error(r)
        assert err["param"] == "input_reference" and "decompression-bomb" in err["message"]
        files = [("input_reference", (f"{i}.png", png(), "image/png")) for i in range(3)]
        err = error(videos.post("/v1/videos", data={"prompt": "a cat"}, files=files))
        assert err["param"] == "input_reference" and "more than 2 files" in err["message"]
        assert videos.get("/v1/videos").json()["data"] == []
    assert i2v.prompts == []


# ---------------------------------------------------------------------- input_reference


def test_a_finished_input_reference_job_keeps_no_image() -> None:
    engine = ImageToVideo()
    app = create_app(engine, settings(max_frames=9))
    with TestClient(app, base_url="http://127.0.0.1", headers=AUTH) as client:
        ids = []
        for prompt in ("a cat", "a FAIL cat"):
            r = client.post("/v1/videos", data={"prompt": prompt, "size": "16x16", "num_frames": "3"},
                            files={"input_reference": ("ref.png", png((16, 16)), "image/png")})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        deadline = time.monotonic() + 20
        jobs = app.state.server.jobs
        while not all(jobs.get(i).finished for i in ids):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        done, failed = (jobs.get(i) for i in ids)
        assert done.status == "completed" and failed.status == "failed"
        assert client.get(f"/v1/videos/{ids[0]}/content").content[4:8] == b"ftyp"  # an mp4
        for job, prompt in ((done, "a cat"), (failed, "a FAIL cat")):
            assert job.payload.prompt == {"prompt": prompt}  # the decoded image dropped
            assert client.get(f"/v1/videos/{job.id}").json()["prompt"] == prompt
    assert [isinstance(p["image"], Image.Image) for p in engine.prompts] == [True, True]


# ---------------------------------------------------------------------- --max-steps


@pytest.mark.parametrize("pipeline", ["StableCascadeCombinedPipeline", "KandinskyCombinedPipeline",
                                      "KandinskyV22CombinedPipeline"])
def test_prior_steps_obey_max_steps(pipeline: str) -> None:
    import diffusers

    knobs, _ = knob_table(getattr(diffusers, pipeline).__call__)
    assert is_steps_knob(knobs["prior_num_inference_steps"])
    limits = Limits(MAX_PIXELS, 9, 8, knobs=knobs)
    for text, value in ((False, 4096), (True, "4096"), (False, 9)):
        req = ImageGenerationRequest.model_validate({"prompt": "x", "prior_num_inference_steps": value})
        with pytest.raises(APIError) as err:
            pipeline_kwargs(req, limits, text=text)
        assert err.value.status == 400 and err.value.param == "prior_num_inference_steps"
        assert err.value.message == (f"Invalid value for 'prior_num_inference_steps': {int(value)} "
                                     "is over this server's limit of 8 (--max-steps).")
    req = ImageGenerationRequest.model_validate({"prompt": "x", "extra_params": {"prior_num_inference_steps": 9}})
    with pytest.raises(APIError) as err:
        pipeline_kwargs(req, limits)
    assert err.value.param == "extra_params.prior_num_inference_steps"
    req = ImageGenerationRequest.model_validate({"prompt": "x", "prior_num_inference_steps": 8})
    assert pipeline_kwargs(req, limits) == {"prior_num_inference_steps": 8}


def test_every_steps_knob_obeys_max_steps_over_http() -> None:
    import diffusers

    knobs, _ = knob_table(diffusers.StableCascadeCombinedPipeline.__call__)
    engine = Editor(knobs)
    engine.knobs = knobs
    with TestClient(create_app(engine, settings()), base_url="http://127.0.0.1", headers=AUTH) as client:
        body = {"prompt": "a car", "size": "16x16", "num_inference_steps": 2}
        err = error(client.post("/v1/images/generations", json={**body, "prior_num_inference_steps": 4096}))
        assert err["param"] == "prior_num_inference_steps" and "limit of 8 (--max-steps)" in err["message"]
        r = client.post("/v1/images/generations", json={**body, "prior_num_inference_steps": 8})
        assert r.status_code == 200, r.text
    assert engine.prompts and len(engine.prompts) == 1
    # steps in other names, lists of them, and what is not a step count
    for name in ("decoder_num_inference_steps", "original_inference_steps", "max_iter_to_alter",
                 "num_temporal_reasoning_steps"):
        with pytest.raises(ValueError, match="over this server's limit of 8"):
            check_knob(Knob(name, "int"), 9, max_steps=8)
        assert check_knob(Knob(name, "int"), 8, max_steps=8) == 8
    pyramid = Knob("pyramid_num_inference_steps_list", "int", is_list=True)
    with pytest.raises(ValueError, match="its steps add up to 12, over this server's limit of 8"):
        check_knob(pyramid, [4, 4, 4], max_steps=8)
    assert check_knob(Knob("timesteps", "int", is_list=True), [999, 500], max_steps=8) == [999, 500]
    assert check_knob(Knob("max_sequence_length", "int"), 512, max_steps=8) == 512
    assert check_knob(Knob("prior_num_inference_steps", "int"), 4096) == 4096  # no server limit
