"""Issue 38 item 5 and 5b's cause: the official SDK's plain image edit (no ``size``, no
knob) on every tiny image model with an edit variant, ``check_inputs`` seen with the
arguments ``__call__`` passes, a fault in the check answered as a 500 with a request id
(never as the model's refusal), and ``serve --ray``'s path (the routes see only what a
generator reports; the job is checked where the model runs) answering as one process.

The apps run in-process (``TestClient``, which the SDK drives as its HTTP client) over
tiny random pipelines on the CPU.
"""

from __future__ import annotations

import base64
import io
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from diffusion_offload.engine import Omni, SamplingParams  # noqa: E402
from diffusion_offload.engine.requests import PromptItem, check_arguments, check_request  # noqa: E402
from diffusion_offload.server import ServerSettings, create_app  # noqa: E402
from diffusion_offload.server.app import build_app  # noqa: E402
from diffusion_offload.server.state import ServerState  # noqa: E402
from diffusion_offload.testing import tiny_pipelines  # noqa: E402

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
IMAGE_KINDS = ("flux", "sd3", "qwen-image")
VARIANTS = {"flux": ("FluxImg2ImgPipeline", "FluxInpaintPipeline"),
            "sd3": ("StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
            "qwen-image": ("QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline")}


def picture(size: tuple[int, int] = (32, 32)) -> Image.Image:
    w, h = size
    return Image.fromarray((np.arange(w * h * 3).reshape(h, w, 3) * 7 % 251).astype("uint8"))


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def settings() -> ServerSettings:
    return ServerSettings(model_id="tiny", api_key=KEY, max_steps=8)


def sdk(client: TestClient) -> Any:
    import openai

    return openai.OpenAI(base_url="http://127.0.0.1/v1", api_key=KEY, http_client=client,
                         max_retries=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("edit-defaults")
    return {kind: tiny_pipelines.save(kind, root / kind) for kind in IMAGE_KINDS}


@pytest.fixture(scope="module")
def flux(models: dict[str, Path]) -> Iterator[Omni]:
    with Omni(str(models["flux"]), device="cpu", progress=False) as engine:
        yield engine


# ---------------------------------------------------------------------- the SDK's plain edit


@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_the_sdks_plain_edit_works_with_its_defaults(kind: str, models: dict[str, Path]) -> None:
    """``client.images.edit(image=..., prompt=...)`` and the same with a mask: nothing
    else sent, so the size is the image's and ``strength`` the variant's own 0.6."""
    with Omni(str(models[kind]), device="cpu", progress=False) as engine, \
            TestClient(create_app(engine, settings()), base_url="http://127.0.0.1") as client:
        api = sdk(client)
        image = ("in.png", png(picture()), "image/png")
        plain = api.images.edit(image=image, prompt="make it red")
        masked = api.images.edit(image=image, prompt="make it red",
                                 mask=("mask.png", png(Image.new("L", (32, 32), 255)), "image/png"))
        for result in (plain, masked):
            out = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
            assert out.format == "PNG" and out.size == (32, 32)
            assert np.asarray(out).std() > 0  # a generated picture, not a blank
        names = {kind: type(v[0]).__name__ for kind, v in engine._variants.items()}
        assert names == dict(zip(("image2image", "inpaint"), VARIANTS[kind]))
        # the check ran in full on each variant (nothing skipped), with __call__'s defaults
        for variant, knobs, refused in engine._variants.values():
            item = PromptItem("make it red", images=(picture(),), mask=Image.new("L", (32, 32)))
            args, unknown = check_arguments(variant, item, {"height": 32, "width": 32})
            assert unknown == [] and args["strength"] == 0.6
            assert check_request(variant, dict(variant.config), item, {"height": 32, "width": 32},
                                 SamplingParams()) is True


def test_a_chat_image_part_with_the_defaults_is_an_edit(flux: Omni) -> None:
    with TestClient(create_app(flux, settings()), base_url="http://127.0.0.1") as client:
        url = "data:image/png;base64," + base64.b64encode(png(picture())).decode()
        r = sdk(client).chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "text", "text": "make it red"}, {"type": "image_url", "image_url": {"url": url}}]}])
        part = r.choices[0].message.content[0]["image_url"]["url"]
        out = Image.open(io.BytesIO(base64.b64decode(part.split(",", 1)[1])))
        assert out.size == (32, 32)


def test_check_arguments_are_those_call_passes(flux: Omni) -> None:
    """An omitted ``height``/``width`` is the size ``__call__`` computes, ``output_type``
    the engine's ``"pil"``; what the request gives wins; prompts are passed as given."""
    item = PromptItem("a car")
    args, unknown = check_arguments(flux.pipeline, item, {})
    side = flux.pipeline.default_sample_size * flux.pipeline.vae_scale_factor
    assert (args["height"], args["width"], args["prompt"], args["prompt_2"]) == (side, side, "a car", None)
    assert args["max_sequence_length"] == 512 and unknown == []
    args, _ = check_arguments(flux.pipeline, item, {"height": 16, "max_sequence_length": 64})
    assert (args["height"], args["width"], args["max_sequence_length"]) == (16, side, 64)
    # a refusal of check_inputs itself is still one: a ValueError with its message
    with pytest.raises(ValueError, match="cannot be greater than 512"):
        flux.check_request("a car", SamplingParams(height=16, width=16,
                                                   extra={"max_sequence_length": 1000}))


def test_a_check_that_cannot_run_without_a_derived_value_is_skipped() -> None:
    """A ``TypeError`` on an argument the request left out and ``__call__`` derives is
    not a refusal: the check says it did not run, the pipeline checks at the call."""

    class Pipe:
        config: dict = {}

        def __call__(self, prompt: str | None = None, num_frames: int | None = None) -> None:
            pass

        def check_inputs(self, prompt, num_frames):
            if num_frames < 1:
                raise ValueError("num_frames must be >= 1")

    item = PromptItem("a cat")
    assert check_arguments(Pipe(), item, {}) == ({"prompt": "a cat", "num_frames": None}, ["num_frames"])
    assert check_request(Pipe(), {}, item, {}, SamplingParams()) is False
    assert check_request(Pipe(), {}, item, {"num_frames": 5}, SamplingParams()) is True
    with pytest.raises(ValueError, match="must be >= 1"):
        check_request(Pipe(), {}, item, {"num_frames": 0}, SamplingParams())
    with pytest.raises(TypeError):  # every argument known: a fault, raised as such
        check_request(Pipe(), {}, item, {"num_frames": "5"}, SamplingParams())


# ---------------------------------------------------------------------- a fault is a 500


def test_a_fault_in_the_check_is_a_500_with_a_request_id_never_a_refusal(
        flux: Omni, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import openai

    def broken(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("'<' not supported between instances of 'NoneType' and 'int'")

    with TestClient(create_app(flux, settings()), base_url="http://127.0.0.1") as client:
        api = sdk(client)
        api.images.edit(image=("in.png", png(picture()), "image/png"), prompt="warm up")
        variant = flux._variants["image2image"][0]
        monkeypatch.setattr(type(variant), "check_inputs", broken)
        with caplog.at_level(logging.ERROR, logger="diffusion_offload.server"):
            with pytest.raises(openai.InternalServerError) as err:
                api.images.edit(image=("in.png", png(picture()), "image/png"), prompt="make it red")
        response = err.value.response
        body = response.json()["error"]
        request_id = response.headers["x-request-id"]
        assert response.status_code == 500 and body["code"] == "internal_error"
        assert request_id.startswith("req_") and request_id in body["message"]
        assert "refused" not in body["message"] and "NoneType" not in body["message"]
        assert f"request {request_id}" in caplog.text and "NoneType" in caplog.text
        monkeypatch.undo()
        assert client.post("/v1/images/edits", headers=AUTH, data={"prompt": "again"},
                           files={"image": ("in.png", png(picture()), "image/png")}).status_code == 200


def test_a_type_error_while_generating_is_a_500_not_a_refusal(flux: Omni) -> None:
    class Faulty:
        is_video = False

        def generate(self, prompts: Any, params: Any) -> Any:
            raise TypeError("unsupported operand type(s) for %: 'NoneType' and 'int'")

    with TestClient(create_app(Faulty(), settings()), base_url="http://127.0.0.1",
                    headers=AUTH) as client:
        r = client.post("/v1/images/generations", json={"prompt": "a car", "size": "16x16"})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["code"] == "generation_failed" and "(job image_" in err["message"]
    assert "NoneType" not in r.text


# ---------------------------------------------------------------------- --ray's path


class RemoteEngine:
    """What ``serve --ray``'s ingress knows of the model (``ray_serve.ingress._RemoteEngine``):
    a generator's description, no pipeline and no ``check_request``."""

    def __init__(self, engine: Omni) -> None:
        self.is_video = engine.is_video
        self.image_input = engine.image_input
        self.pipeline_class = engine.pipeline_class
        self._tables = {mask: engine.knobs_for(mask) for mask in (False, True)}

    def knobs_for(self, mask: bool) -> tuple[dict, dict]:
        return self._tables[mask]

    def generate(self, prompts: Any, params: Any) -> Any:
        raise AssertionError("the ingress never generates")


class RayLikeState(ServerState):
    """``serve --ray`` in one process: the routes over :class:`RemoteEngine` and the
    generator's limits, each job run by a generator's ``ServerState.execute`` on the
    real engine (what ``DiffusionGenerator.run`` does)."""

    def __init__(self, engine: Omni, settings: ServerSettings) -> None:
        super().__init__(RemoteEngine(engine), settings)
        self.generator = ServerState(engine, settings)
        self.rules, self.limits = self.generator.rules, self.generator.limits

    def _run_job(self, job: Any) -> Any:
        return self.generator.execute(job)


def test_ray_path_refuses_and_edits_as_one_process(flux: Omni) -> None:
    edit = {"prompt": "make it red", "seed": "5", "num_inference_steps": "2"}
    files = {"image": ("in.png", png(picture()), "image/png")}
    refused_generation = {"prompt": "a car", "size": "16x16", "num_inference_steps": 1,
                          "max_sequence_length": 1000}
    answers = []
    for state in (ServerState(flux, settings()), RayLikeState(flux, settings())):
        with TestClient(build_app(state), base_url="http://127.0.0.1", headers=AUTH) as client:
            answers.append([
                client.post("/v1/images/generations", json=refused_generation),
                client.post("/v1/images/edits", data={**edit, "max_sequence_length": "1000"},
                            files=files),
                client.post("/v1/images/edits", data=edit, files=files),
            ])
    one, ray = answers
    for a, b in zip(one[:2], ray[:2]):
        assert a.status_code == b.status_code == 400, (a.text, b.text)
        assert a.json() == b.json()
        err = a.json()["error"]
        assert err["code"] == "invalid_value" and err["message"].startswith(
            "Invalid request: the model refused it: `max_sequence_length` cannot be greater than 512")
    assert one[2].status_code == ray[2].status_code == 200
    assert one[2].json()["data"] == ray[2].json()["data"]  # the same image, byte for byte


def test_a_refusal_crosses_a_process_boundary_with_its_message_and_field() -> None:
    """What a generator replica raises reaches the job index pickled (Ray): the failed
    job then answers the single-process pre-check's 400, ``param`` included."""
    import pickle

    from diffusion_offload.engine.knobs import KnobError
    from diffusion_offload.server.jobs import Job, JobManager
    from diffusion_offload.server.state import (
        JobSpec, RequestRefused, job_error_code, job_error_message, job_failure, refusal_error,
    )

    for exc in (ValueError("`max_sequence_length` cannot be greater than 512 but is 1000"),
                KnobError("strength", "Invalid value for 'strength': must be from 0 to 1, got 2.")):
        refused = pickle.loads(pickle.dumps(RequestRefused.of(exc)))
        want = refusal_error(exc)

        def runner(job: Job, refused: RequestRefused = refused) -> None:
            raise refused

        jobs = JobManager(runner, 4, error_code=job_error_code, error_message=job_error_message)
        jobs.start()
        job = Job("image", JobSpec("a car", SamplingParams(width=16, height=16)))
        done = __import__("threading").Event()
        job.add_done_callback(lambda _: done.set())
        jobs.submit(job)
        assert done.wait(10)
        jobs.shutdown(1.0)
        got = job_failure(job)
        assert (got.status, got.param, got.code, got.message) == (400, want.param, "invalid_value",
                                                                  want.message)
    assert want.param == "strength" and want.message.startswith("Invalid value for 'strength'")
