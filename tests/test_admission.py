"""Admission before OOM (issue 35 item 4): a request whose predicted device peak cannot fit
is refused before it runs, naming the model, the peak, the device bytes and what fits; a
refused request is one that runs out of memory when forced; one the rule admits and the
planner predicts to fit runs."""

from __future__ import annotations

import gc

import pytest
import torch

from diffusion_offload import Omni, SamplingParams
from diffusion_offload.engine.admission import MARGIN, Admission
from diffusion_offload.models.fit import FitError
from diffusion_offload.models.rules import ModelRules
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

MODULE = {"mode": "module", "components": ["dit", "text_encoder"]}


def _rules(video: bool) -> ModelRules:
    defaults = {"height": 64, "width": 64, "num_inference_steps": 2, "num_frames": 9 if video else None}
    return ModelRules("P", video, 16, 4 if video else None, defaults)


def _area_peak(shape) -> int:
    """A monotone stand-in for the planner: 1,000 bytes of weights plus 1 byte a pixel a
    frame."""
    height, width, frames = shape[:3]
    return 1_000 + height * width * (frames or 1)


def test_the_rule_refuses_only_past_the_lower_bound_and_names_what_fits():
    calls: list = []

    def predict(shape):
        calls.append(shape)
        return _area_peak(shape)

    adm = Admission("tiny-flux", 10_000, predict, _rules(False))
    assert adm.shape_of({}, negative=False) == (64, 64, None, 2, False, None)
    assert adm.shape_of({"height": 96, "width": 48}, negative=True) == (96, 48, None, 2, None, None)
    # 96x96: 10,216 bytes predicted, its lower bound 10,216 / 1.1 within 10,000: admitted
    adm.check((96, 96, None, 2, None, None))
    assert adm.fits((96, 96, None, 2, None, None)) and 10_216 / MARGIN <= 10_000 < 10_216
    with pytest.raises(FitError) as err:  # 128x128: 17,384 > 1.1 x 10,000
        adm.check((128, 128, None, 2, None, None))
    # the largest square within 10,000 bytes: 96x96 is 10,216 > 10,000, 80x80 is 7,400
    assert str(err.value) == (
        "model 'tiny-flux' cannot run 128x128: the planner predicts a device peak of 17384 "
        "bytes (at least 15803), and the device has 10000 bytes; the largest size that fits is 80x80")
    before = len(calls)
    adm.check((96, 96, None, 2, None, None))
    assert len(calls) == before  # one prediction a shape


def test_a_video_refusal_names_the_size_and_the_frames_that_fit():
    adm = Admission("tiny-wan", 30_000, _area_peak, _rules(True))
    with pytest.raises(FitError) as err:  # 64x64x33: 136,168 bytes
        adm.check((64, 64, 33, 2, None, None))
    # at 33 frames: 16x16 (9,448) fits, 32x32 (34,792) does not; at 64x64: 5 frames
    # (21,480) fit, 9 (37,864) do not
    assert str(err.value).endswith(
        "the largest size that fits is 16x16 at 33 frames; at 64x64 at most 5 frames fit")


def test_admission_turns_off_where_the_planner_has_no_rule():
    def predict(shape):
        raise ValueError("no activation model for WanImageToVideoPipeline")

    adm = Admission("i2v", 1, predict, _rules(True))
    adm.check((4096, 4096, 81, 50, None, None))  # not refused: nothing is known
    assert not adm.enabled and adm.peak((64, 64, 9, 2, None, None)) is None


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            path = tmp_path_factory.mktemp(f"admission-{kind}")
            tiny_pipelines.save(kind, path)
            made[kind] = str(path)
        return made[kind]

    return get


# module mode at a fixed capacity per tiny model; measured peaks at 256 / 384 / 512 pixels:
# Wan2.2 (5 frames) 27.1 / 60.7 / 107.8 MB, FLUX 16.1 / 35.8 / 63.5 MB
CAPACITY = {"wan2.2": 40_000_000, "flux": 25_000_000}


@pytest.mark.parametrize("side", [256, 384, 512])
@pytest.mark.parametrize("kind", ["wan2.2", "flux"])
def test_a_refused_request_runs_out_of_memory_when_forced(kind, side, tiny_dirs, fake_device):
    gc.collect()
    capacity = CAPACITY[kind]
    fa.set_capacity(capacity)
    frames = 5 if kind.startswith("wan") else None
    params = SamplingParams(height=side, width=side, num_frames=frames, num_inference_steps=2)
    prompt = {"prompt": "a cat", "negative_prompt": "blurry"}
    folder = tiny_dirs(kind)
    try:
        engine = Omni(folder, MODULE, device="fakegpu", progress=False)
        try:
            assert engine.admission is not None and engine.admission.capacity == capacity
            shape = engine.admission.shape_of({"height": side, "width": side, "num_frames": frames,
                                               "num_inference_steps": 2}, negative=True)
            peak = engine.admission.peak(shape)
            refused = False
            try:
                engine.check_request(prompt, params)
            except FitError as exc:
                refused = True
                assert f"device peak of {peak} bytes" in str(exc) and f"has {capacity} bytes" in str(exc)
                assert "the largest size that fits is" in str(exc)
                with pytest.raises(FitError):  # generate refuses it too, before running
                    engine.generate(prompt, params)
            assert refused == (peak > MARGIN * capacity) == (side > 256)
            if not refused and peak <= capacity:
                engine.generate(prompt, params)  # predicted to fit: it runs
        finally:
            engine.close()
        if refused:  # forced: the same request without admission runs out of memory
            forced = Omni(folder, MODULE, device="fakegpu", progress=False, admission=False)
            try:
                assert forced.admission is None
                with pytest.raises(torch.OutOfMemoryError):
                    forced.generate(prompt, params)
            finally:
                forced.close()
    finally:
        gc.collect()
        fa.set_capacity(None)


def test_predict_peak_is_the_plan_row_of_the_same_config(tiny_dirs):
    """``predict_peak`` walks an engine config exactly as ``plan_model``'s row for it."""
    from diffusion_offload.core.config import parse_diffusion_offload_config
    from diffusion_offload.planner.model import load_plan_model
    from diffusion_offload.planner.plan import plan_model, predict_peak, resolve_request

    pm = load_plan_model(tiny_dirs("wan2.2"))
    request = resolve_request(pm, 64, 64, 5, 2)
    rows = {r.name: r for r in plan_model(pm, request, 10**9, device_kind="fakegpu")}
    for name, row in rows.items():
        config = row.config["diffusion_offload_config"]
        parsed = None if config is None else parse_diffusion_offload_config(config)
        peak = predict_peak(pm, request, parsed, row.config.get("device_memory_budget"),
                            device_kind="fakegpu")
        assert peak == row.peak_bytes, name
    with pytest.raises(ValueError, match="legacy"):
        predict_peak(pm, request, parse_diffusion_offload_config(None, enable_cpu_offload=True))


@pytest.mark.parametrize("kind", ["flux", "wan2.2"])
def test_serve_answers_a_refused_request_with_a_400_before_queueing(kind, tiny_dirs, fake_device):
    """Through HTTP: the 400 envelope names the model by its served id, the peak, the device
    bytes and what fits, with ``code`` ``admission_refused`` and ``param`` ``size``; no job
    is queued (a video gets no job id), and a size that fits still runs."""
    from fastapi.testclient import TestClient

    from diffusion_offload.engine.admission import AdmissionError
    from diffusion_offload.server import ServerSettings, create_app

    gc.collect()
    capacity = CAPACITY[kind]
    fa.set_capacity(capacity)
    video = kind.startswith("wan")
    try:
        with Omni(tiny_dirs(kind), MODULE, device="fakegpu", progress=False, name=f"served-{kind}") as engine:
            app = create_app(engine, ServerSettings(model_id=f"served-{kind}", max_steps=8))
            with TestClient(app, base_url="http://127.0.0.1") as client:
                route = "/v1/videos" if video else "/v1/images/generations"
                body = {"prompt": "a cat", "negative_prompt": "blurry", "num_inference_steps": 2}
                if video:
                    body |= {"num_frames": 5}
                shape = engine.admission.shape_of({"height": 512, "width": 512, "num_frames": 5 if video else None,
                                                   "num_inference_steps": 2}, negative=True)
                peak = engine.admission.peak(shape)
                answer = client.post(route, json=body | {"size": "512x512"})
                assert answer.status_code == 400, answer.text
                error = answer.json()["error"]
                assert error["code"] == "admission_refused" and error["param"] == "size"
                assert error["message"].startswith(f"model 'served-{kind}' cannot run 512x512")
                assert f"device peak of {peak} bytes" in error["message"]
                assert f"the device has {capacity} bytes" in error["message"]
                assert "the largest size that fits is" in error["message"]
                if video:
                    assert client.get("/v1/videos").json()["data"] == []  # nothing was queued
                with pytest.raises(AdmissionError) as raised:  # the same refusal from the API
                    engine.check_request({"prompt": "a cat", "negative_prompt": "blurry"},
                                         SamplingParams(height=512, width=512, num_frames=5 if video else None,
                                                        num_inference_steps=2))
                assert raised.value.peak == peak and raised.value.capacity == capacity
                assert str(raised.value) == error["message"]
                fits = client.post(route, json=body | {"size": "32x32"})
                assert fits.status_code == 200, fits.text
    finally:
        gc.collect()
        fa.set_capacity(None)
