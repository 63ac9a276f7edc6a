"""The ``Omni`` engine end to end (issue 4 "Must show", engine part).

Tiny random-weight pipelines of every kind are saved in diffusers format to temporary
folders (one per kind, per module) and loaded back by path through ``Omni``; one is also
loaded by hub id from a Hugging Face cache layout the test builds. Weight moves are
checked against the fake accelerator's own counters.

Offload vs all-resident runs are measured one engine at a time: the all-resident engine
is built, measured around one ``generate`` call and closed, then the offload engine. Two
engines alive on one fake device share its memory counters, so the peak of one request
would include the other engine's weights in whatever state its last request left them.
Each measurement is taken around the ``generate`` call only (``reset_stats`` before,
``stats`` after), so the weights an engine moves while it is built are not part of it.
"""

from __future__ import annotations

import gc
import json
import re

import numpy as np
import pytest
import torch

from diffusion_offload.core.config import parse_diffusion_offload_config
from diffusion_offload.engine import (
    FitError,
    GenerationOutput,
    ModelError,
    Omni,
    SamplingParams,
)
from diffusion_offload.models.fit import footprint
from diffusion_offload.models.files import inspect_model
from diffusion_offload.engine.omni import parse_dtype
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}
_SAMPLING_KEYS = ("height", "width", "num_frames", "num_inference_steps", "guidance_scale", "guidance_scale_2")
_STAGES = ("text_encoding", "denoising", "decoding")
HUB_ID = "tiny-org/tiny-flux-diffusers"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """``models(kind)``: the folder of the tiny ``kind`` pipeline (saved once per module)."""
    cache: dict[str, object] = {}

    def get(kind: str):
        if kind not in cache:
            folder = tmp_path_factory.mktemp(kind.replace(".", "_").replace("-", "_"))
            cache[kind] = tiny_pipelines.save(kind, folder / "model")
        return cache[kind]

    return get


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, models):
    """A Hugging Face cache holding ``HUB_ID`` (the tiny flux pipeline), offline mode on.

    Layout as ``huggingface_hub`` writes it: ``models--org--name/blobs/<hash>``,
    ``snapshots/<commit>/<path>`` symlinks to the blobs, and ``refs/main`` = the commit.
    ``huggingface_hub.constants`` reads the environment at import time, so the constants
    are patched as well as the variables.
    """
    import hashlib

    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hf" / "hub"
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / HUB_COMMIT
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)
    source = models("flux")
    for file in sorted(p for p in source.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return snapshot


def _params(kind: str, **overrides) -> SamplingParams:
    """The tiny sizes of ``default_call_kwargs(kind)`` as ``SamplingParams``."""
    values = {k: v for k, v in tiny_pipelines.default_call_kwargs(kind).items() if k in _SAMPLING_KEYS}
    values.update(overrides)
    return SamplingParams(**values)


def _pixels(output: GenerationOutput, index: int = 0) -> np.ndarray:
    """Output ``index`` of ``output`` as a uint8 array (frames stacked for a video)."""
    if output.frames is not None:
        assert output.images is None
        return np.stack([np.asarray(f) for f in output.frames[index]])
    assert output.frames is None
    return np.asarray(output.images[index])


def _measured(engine: Omni, prompt, params: SamplingParams) -> tuple[GenerationOutput, dict[str, int]]:
    """One ``generate`` call and the fake device's counters for exactly that call."""
    fa.reset_stats()
    (output,) = engine.generate(prompt, params)
    return output, fa.stats()


def _trace_spans(trace: dict, name: str) -> list[dict]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["name"] == name]


# --------------------------------------------------------------------------- offload == all-resident


CASES = [(kind, "path") for kind in tiny_pipelines.KINDS] + [("flux", "hub id")]


@pytest.mark.parametrize("kind, source", CASES, ids=[f"{k}-{s.replace(' ', '_')}" for k, s in CASES])
def test_offload_matches_all_resident(kind, source, models, request, fake_device):
    """Module offload of dit + text_encoder: same pixels, weight bytes = device totals minus
    the all-resident run's, lower peak, device memory released on close."""
    path = models(kind)
    model, snapshot = path, None
    if source == "hub id":
        snapshot = request.getfixturevalue("hub_cache")
        model = HUB_ID
    params = _params(kind, seed=3)
    image = tiny_pipelines.default_call_kwargs(kind).get("image")  # image-to-video
    prompt = "a cat on a mat" if image is None else {"prompt": "a cat on a mat", "image": image}
    gc.collect()  # earlier tests' garbage must not be freed inside the measurement
    baseline = fa.stats()["allocated_bytes"]

    with Omni(path, None, device="fakegpu", progress=False) as resident:
        ref, ref_dev = _measured(resident, prompt, params)
    gc.collect()
    assert fa.stats()["allocated_bytes"] == baseline

    with Omni(model, FULL, device="fakegpu", progress=False) as engine:
        if snapshot is not None:  # resolved through the cache, not a local folder
            assert engine.model == HUB_ID and engine.info.path == snapshot
        out, dev = _measured(engine, prompt, params)
    gc.collect()
    assert fa.stats()["allocated_bytes"] == baseline

    got, want = _pixels(out), _pixels(ref)
    assert got.shape == want.shape
    expected_hw = (params.height, params.width)
    assert want.shape[-3:-1] == expected_hw
    if params.num_frames is not None:
        assert want.shape[0] == params.num_frames
    np.testing.assert_array_equal(got, want)

    stats = out.offload_stats
    # plus the write checks' random weights (one copy of 8 bytes per grid column a check)
    assert stats["h2d_bytes"] + stats["check_h2d_bytes"] == dev["h2d_bytes"] - ref_dev["h2d_bytes"]
    # plus the write checks' read-backs (none when nothing changed)
    assert stats["d2h_bytes"] + stats["check_d2h_bytes"] == dev["d2h_bytes"] - ref_dev["d2h_bytes"]
    assert stats["h2d_bytes"] > 0 and stats["loads"] >= 1 and stats["evictions"] >= 1
    assert ref.offload_stats["h2d_bytes"] == 0 and ref.offload_stats["loads"] == 0
    assert 0 < out.peak_device_memory_bytes < ref.peak_device_memory_bytes
    assert out.peak_device_memory_bytes == dev["peak_bytes"]
    assert set(out.peak_host_memory) == {"rss_anon_bytes", "rss_file_bytes"}


def test_the_host_peak_sees_an_allocation_made_and_freed_inside_it():
    """``PeakHostMemory``: 64 MiB written and freed inside the ``with`` raise the sampled
    anonymous peak by at least 60 MiB over the resident bytes at entry."""
    import time

    from diffusion_offload.engine.hostrss import PeakHostMemory, rss

    before = rss()["rss_anon_bytes"]
    with PeakHostMemory(interval=0.001) as host:
        block = np.ones(64 << 20, dtype=np.uint8)  # written: resident
        time.sleep(0.05)  # several samples while it is alive
        del block
    assert host.peak["rss_anon_bytes"] >= before + (60 << 20), (host.peak, before)
    assert rss()["rss_anon_bytes"] < host.peak["rss_anon_bytes"]


def test_unknown_hub_id_offline(hub_cache):
    with pytest.raises(ModelError) as info:
        Omni("tiny-org/no-such-model", FULL, device="fakegpu")
    message = str(info.value)
    assert "'tiny-org/no-such-model'" in message
    assert "not found in the local Hugging Face cache" in message and "HF_HUB_OFFLINE=1" in message


def test_missing_and_invalid_models(tmp_path):
    with pytest.raises(ModelError, match="not an existing directory"):
        Omni(str(tmp_path / "missing"), device="cpu")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ModelError, match="no model_index.json"):
        Omni(tmp_path / "plain", device="cpu")
    (tmp_path / "svd").mkdir()  # no prompt: image in, video out
    (tmp_path / "svd" / "model_index.json").write_text(json.dumps({"_class_name": "StableVideoDiffusionPipeline"}))
    with pytest.raises(ModelError, match="'StableVideoDiffusionPipeline' is not supported"):
        Omni(tmp_path / "svd", device="cpu")


# --------------------------------------------------------------------------- SamplingParams, prompts, seeds


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"height": "32"}, TypeError),
        ({"height": 32.0}, TypeError),
        ({"width": True}, TypeError),
        ({"num_frames": None, "height": 0}, ValueError),
        ({"width": -16}, ValueError),
        ({"num_frames": 0}, ValueError),
        ({"fps": 1.5}, TypeError),
        ({"num_inference_steps": 0}, ValueError),
        ({"guidance_scale": "5"}, TypeError),
        ({"guidance_scale": False}, TypeError),
        ({"guidance_scale": -0.5}, ValueError),
        ({"guidance_scale_2": -1}, ValueError),
        ({"seed": -1}, ValueError),
        ({"seed": 1.0}, TypeError),
        ({"num_outputs_per_prompt": 0}, ValueError),
    ],
)
def test_sampling_params_rejects(kwargs, error):
    name = next(k for k, v in kwargs.items() if v is not None)
    with pytest.raises(error, match=f"SamplingParams.{name}"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts():
    params = SamplingParams(height=32, width=48, guidance_scale=3, guidance_scale_2=0.0, seed=0, fps=8)
    assert params.as_dict() == {"height": 32, "width": 48, "guidance_scale": 3, "guidance_scale_2": 0.0, "seed": 0, "fps": 8}
    assert SamplingParams().as_dict() == {}


@pytest.fixture(scope="module")
def sd3_cpu(models):
    """An SD3 engine on the CPU (the request semantics do not depend on the device)."""
    with Omni(models("sd3"), None, device="cpu", progress=False) as engine:
        yield engine


def test_seeds(sd3_cpu):
    params = _params("sd3", seed=7)
    (a,) = sd3_cpu.generate("a red car", params)
    (b,) = sd3_cpu.generate("a red car", params)
    (c,) = sd3_cpu.generate("a red car", _params("sd3", seed=8))
    (pair,) = sd3_cpu.generate("a red car", _params("sd3", seed=7, num_outputs_per_prompt=2))
    np.testing.assert_array_equal(_pixels(a), _pixels(b))
    assert not np.array_equal(_pixels(a), _pixels(c))
    assert len(pair.images) == 2
    np.testing.assert_array_equal(_pixels(pair, 0), _pixels(a))
    np.testing.assert_array_equal(_pixels(pair, 1), _pixels(c))
    # no seed: seed 0
    (default,) = sd3_cpu.generate("a red car", _params("sd3"))
    (zero,) = sd3_cpu.generate("a red car", _params("sd3", seed=0))
    np.testing.assert_array_equal(_pixels(default), _pixels(zero))


def test_prompt_forms(sd3_cpu):
    params = _params("sd3", seed=1)
    (plain,) = sd3_cpu.generate("a blue house", params)
    assert plain.prompt == "a blue house" and plain.negative_prompt is None
    assert plain.frames is None and len(plain.images) == 1
    (neg,) = sd3_cpu.generate({"prompt": "a blue house", "negative_prompt": "blurry"}, params)
    assert neg.prompt == "a blue house" and neg.negative_prompt == "blurry"
    assert not np.array_equal(_pixels(neg), _pixels(plain))  # guidance 5: the negative prompt counts
    outputs = sd3_cpu.generate(["a dog", {"prompt": "a blue house", "negative_prompt": "blurry"}, "a blue house"], params)
    assert [o.prompt for o in outputs] == ["a dog", "a blue house", "a blue house"]
    np.testing.assert_array_equal(_pixels(outputs[1]), _pixels(neg))
    np.testing.assert_array_equal(_pixels(outputs[2]), _pixels(plain))
    (dict_only,) = sd3_cpu.generate({"prompt": "a blue house"}, params)
    np.testing.assert_array_equal(_pixels(dict_only), _pixels(plain))


@pytest.mark.parametrize(
    "prompts, error, pattern",
    [
        ([], ValueError, "must not be empty"),
        (5, TypeError, "prompts must be"),
        ([b"bytes"], TypeError, "prompts must be"),
        ({"prompt": "x", "negative": "y"}, ValueError, "unknown keys"),
        ({"prompt": 3}, TypeError, "prompt must be a str"),
        ({"negative_prompt": "y"}, TypeError, "prompt must be a str"),
        ({"prompt": "x", "negative_prompt": 1}, TypeError, "negative_prompt must be"),
    ],
)
def test_bad_prompts(sd3_cpu, prompts, error, pattern):
    with pytest.raises(error, match=pattern):
        sd3_cpu.generate(prompts, _params("sd3"))


def test_parameters_the_pipeline_does_not_take(sd3_cpu):
    with pytest.raises(ValueError, match="num_frames"):
        sd3_cpu.generate("a cat", _params("sd3", num_frames=5))
    with pytest.raises(ValueError, match="guidance_scale_2"):
        sd3_cpu.generate("a cat", _params("sd3", guidance_scale_2=2.0))


# --------------------------------------------------------------------------- dtype, roles


@pytest.mark.parametrize("value", ["float64", "fp16", "Float32", 16, torch.int8, torch.float64])
def test_bad_dtype(value, models):
    with pytest.raises(ValueError, match="allowed values"):
        parse_dtype(value)
    with pytest.raises(ValueError, match="allowed values"):
        Omni(models("sd3"), device="cpu", dtype=value)


def test_dtype_parsing():
    assert parse_dtype(None) == "auto" and parse_dtype("auto") == "auto"
    assert parse_dtype("float32") is torch.float32
    assert parse_dtype("float16") is torch.float16
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype(torch.bfloat16) is torch.bfloat16


def _weight_dtypes(engine: Omni) -> set[torch.dtype]:
    return {p.dtype for p in engine.pipeline.transformer.parameters()}


def test_dtype_auto_and_explicit(models, tmp_path):
    from diffusers import DiffusionPipeline

    path = models("sd3")
    with Omni(path, device="cpu") as engine:  # dtype None = auto: the checkpoint is float32
        assert engine.dtype is torch.float32 and _weight_dtypes(engine) == {torch.float32}
    with Omni(path, device="cpu", dtype="bfloat16") as engine:
        assert engine.dtype is torch.bfloat16 and _weight_dtypes(engine) == {torch.bfloat16}
    bf16 = tmp_path / "sd3-bf16"
    DiffusionPipeline.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(bf16)
    assert inspect_model(bf16).checkpoint_dtype() == "BF16"
    with Omni(bf16, device="cpu", dtype="auto") as engine:
        assert engine.dtype is torch.bfloat16 and _weight_dtypes(engine) == {torch.bfloat16}
    with Omni(bf16, device="cpu", dtype="float32") as engine:
        assert engine.dtype is torch.float32 and _weight_dtypes(engine) == {torch.float32}


def test_component_roles(models, fake_device):
    path = models("flux")
    with pytest.raises(ValueError, match=r"'nope', which is not a component of FluxPipeline"):
        Omni(path, FULL, device="fakegpu", component_roles={"nope": "dit"})
    with pytest.raises(ValueError, match=r"component_roles\['vae'\]='bogus' is not allowed; allowed roles"):
        Omni(path, FULL, device="fakegpu", component_roles={"vae": "bogus"})
    with pytest.raises(TypeError, match="component_roles must be a mapping"):
        Omni(path, FULL, device="fakegpu", component_roles=["text_encoder_2"])
    with Omni(path, FULL, device="fakegpu", component_roles={"text_encoder_2": "resident"}) as engine:
        selected = {name for name, w in engine.backend.components.items() if w.selected}
        assert selected == {"transformer", "text_encoder"}
        assert engine.pipeline.text_encoder_2.shared.weight.device.type == "fakegpu"


# --------------------------------------------------------------------------- fit check, OOM


def _nums(message: str) -> list[int]:
    return [int(n) for n in re.findall(r"\b\d+\b", message)]


def test_fit_check(models, fake_device):
    path = models("flux")
    info = inspect_model(path)
    need_full = footprint(info, parse_diffusion_offload_config(FULL), 4, True).device_bytes
    need_none = footprint(info, None, 4, True).device_bytes
    assert need_full < need_none
    allocated = fa.stats()["allocated_bytes"]

    # cannot hold the largest group plus residents: refused, both numbers, a suggestion
    fa.set_capacity(allocated + need_full - 1)
    with pytest.raises(FitError) as refused:
        Omni(path, FULL, device="fakegpu", progress=False)
    message = str(refused.value)
    assert f"needs {need_full} bytes" in message and f"only {need_full - 1} bytes are free" in message
    assert "the planner predicts that no candidate fits" in message  # module and layer alike
    assert fa.stats()["allocated_bytes"] == allocated  # nothing was loaded

    # no offload does not fit; the full config would at rest, but its predicted peak
    # (activations included) would not: the advice, the planner's, does not suggest it
    fa.set_capacity(allocated + need_full)
    with pytest.raises(FitError) as refused:
        Omni(path, None, device="fakegpu", progress=False)
    message = str(refused.value)
    assert f"needs {need_none} bytes" in message and f"only {need_full} bytes are free" in message
    assert "the planner predicts that no candidate fits" in message, message
    assert "try --diffusion-offload-config" not in message

    # a device that holds the largest group is accepted; with room for activations it generates
    with Omni(path, FULL, device="fakegpu", progress=False) as engine:
        assert engine.footprint.device_bytes == need_full
        assert fa.stats()["allocated_bytes"] - allocated <= need_full
        fa.set_capacity(allocated + need_full + 64 * 2**20)
        (out,) = engine.generate("a cat", _params("flux"))
        assert out.images[0].size == (32, 32)


def test_oom_during_a_request_names_stage_and_component(models, fake_device):
    """Capacity set after loading: the text encoders' reload fails; the engine recovers."""
    path = models("flux")
    params = _params("flux")
    with Omni(path, {"mode": "module", "components": ["text_encoder"]}, device="fakegpu", progress=False,
              admission=False) as engine:  # past admission (tests/test_admission.py): the OOM itself
        (first,) = engine.generate("a cat", params)  # ends with the text encoders on the host
        fa.set_capacity(fa.stats()["allocated_bytes"] + 1024)  # room for the token ids only
        with pytest.raises(torch.OutOfMemoryError) as info:
            engine.generate("a cat", params)
        message = str(info.value)
        assert "stage 'text_encoding'" in message
        assert re.search(r"loading component 'text_encoder(_2)?'", message), message
        fa.set_capacity(None)
        (again,) = engine.generate("a cat", params)
        np.testing.assert_array_equal(_pixels(again), _pixels(first))


# --------------------------------------------------------------------------- timings, trace, close


def test_layer_mode_trace_has_block_spans_on_the_component_lanes(models, fake_device):
    """Layer mode: each streamed component's lane holds its blocks' load, prefetch,
    release and host-wait spans, one per event the streamer counted."""
    path = models("wan2.2")
    params = _params("wan2.2")
    layer = {"mode": "layer", "components": ["dit", "text_encoder"]}
    with Omni(path, layer, device="fakegpu", progress=False, trace=True) as engine:
        engine.generate("a cat", params)
        before = engine.backend.stats.snapshot()
        count = len([e for e in engine.trace_dict()["traceEvents"] if e["ph"] == "X"])
        (out,) = engine.generate("a cat", params)
        done = engine.backend.stats.since(before)
        blocks = {name: list(names) for name, names in engine.backend.blocks.items()}
        trace = engine.trace_dict()
        events = [e for e in trace["traceEvents"] if e["ph"] == "X"][count:]
    lanes = {m["args"]["name"]: m["tid"] for m in trace["traceEvents"] if m["ph"] == "M"}
    spans = [e for e in events if e["ph"] == "X" and e["tid"] != 0]
    by_name: dict[str, list[dict]] = {}
    for e in spans:
        by_name.setdefault(e["name"], []).append(e)
    assert len(by_name["prefetch"]) == done.prefetches > 0
    assert len(by_name.get("load", [])) == done.fallback_loads
    assert len(by_name["release"]) == done.evictions
    assert len(by_name["host wait"]) == done.device_checks > 0  # the carried blocks' device checks
    streamed = {"transformer", "transformer_2", "text_encoder"}
    for e in spans:
        assert e["cat"] in streamed and e["tid"] == lanes[e["cat"]]
        assert e["args"]["block"] in blocks[e["cat"]] and e["args"]["bytes"] > 0
    assert {e["cat"] for e in by_name["release"]} == streamed
    assert out.offload_stats["h2d_bytes"] == done.h2d_bytes


def test_timings_and_trace(models, fake_device):
    path = models("flux")
    params = _params("flux")
    with Omni(path, FULL, device="fakegpu", progress=False, trace=True) as engine:
        assert engine.trace_dict()["traceEvents"] is not None
        (first,) = engine.generate("a cat", params)
        trace = engine.trace_dict()
        assert len(_trace_spans(trace, "load")) == first.offload_stats["loads"] >= 1
        assert len(_trace_spans(trace, "evict")) == first.offload_stats["evictions"]
        (second,) = engine.generate("a cat", params)
        trace = engine.trace_dict()

    loads = first.offload_stats["loads"] + second.offload_stats["loads"]
    assert second.offload_stats["loads"] > first.offload_stats["loads"]  # the encoders reload
    assert len(_trace_spans(trace, "load")) == loads
    assert len(_trace_spans(trace, "evict")) == first.offload_stats["evictions"] + second.offload_stats["evictions"]
    json.dumps(trace)  # plain JSON

    # timings
    assert first.timings["load"] == engine.load_seconds > 0  # only the request after loading
    assert set(second.timings) == {*_STAGES, "total"}
    for out in (first, second):
        assert all(v >= 0 for v in out.timings.values())
        stages = sum(out.timings[s] for s in _STAGES)
        assert stages - 1e-3 <= out.timings["total"] < stages + 1.0  # the request, load excluded
        assert out.timings["denoising"] > 0

    # format: object format, complete events in microseconds, metadata names the lanes
    events = trace["traceEvents"]
    assert all(e["ph"] in ("X", "M") for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], (int, float)) and e["dur"] >= 0 and e["pid"] == 1 for e in spans)
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert lanes[0] == "stages"
    stage_spans = [e for e in spans if e["tid"] == 0]
    assert [e["name"] for e in stage_spans] == list(_STAGES) * 2
    first_stage_us = sum(e["dur"] for e in stage_spans[:3])
    assert first_stage_us == pytest.approx(sum(first.timings[s] for s in _STAGES) * 1e6, rel=1e-3, abs=5)
    # one tid per component, each component on its own lane
    component_spans = [e for e in spans if e["tid"] != 0]
    assert {e["name"] for e in component_spans} <= {"load", "resident", "evict"}
    tid_of: dict[str, int] = {}
    for e in component_spans:
        assert tid_of.setdefault(e["cat"], e["tid"]) == e["tid"]
        assert lanes[e["tid"]] == e["cat"]
    assert len(set(tid_of.values())) == len(tid_of)
    assert set(tid_of) == {"transformer", "text_encoder", "text_encoder_2"}
    for e in _trace_spans(trace, "load"):
        assert e["args"]["bytes"] > 0
    # load spans nest in time: a load of a lane ends before its next evict starts
    for name, tid in tid_of.items():
        lane = sorted((e for e in component_spans if e["tid"] == tid), key=lambda e: e["ts"])
        for a, b in zip(lane, lane[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1, (name, a, b)


def test_no_trace_without_trace_flag(models):
    with Omni(models("sd3"), device="cpu") as engine:
        with pytest.raises(RuntimeError, match="trace=True"):
            engine.trace_dict()


def test_close_and_context_manager(models, fake_device):
    path = models("flux")
    gc.collect()
    baseline = fa.stats()["allocated_bytes"]
    with Omni(path, FULL, device="fakegpu", progress=False) as engine:
        assert fa.stats()["allocated_bytes"] > baseline
        backend = engine.backend
        assert backend.is_enabled()
    assert engine.pipeline is None and not backend.is_enabled()
    gc.collect()
    assert fa.stats()["allocated_bytes"] == baseline
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate("a cat", _params("flux"))

    engine = Omni(path, None, device="fakegpu", progress=False)
    assert fa.stats()["allocated_bytes"] > baseline
    engine.close()
    gc.collect()
    assert fa.stats()["allocated_bytes"] == baseline
