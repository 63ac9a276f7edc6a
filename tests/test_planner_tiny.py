"""The planner against the fake device, on the tiny pipelines (issue 13, "Must show").

For every candidate of every tiny kind, the pipeline runs on the fake accelerator with its
capacity set to ``device_memory``:

* at ``device_memory = predicted peak`` the plan says ``fits`` and a request does not run
  out of memory; the measured peak (``fake_accelerator.stats()['peak_bytes']``, exact byte
  accounting) is at most the predicted one, and the prediction is at most 10 % above it
  (the steady state of back-to-back requests, which the plan covers too, is checked by
  ``test_back_to_back_requests_stay_under_the_prediction``);
* at ``device_memory = predicted peak / 1.10 - 1`` the plan says it does not fit, and the
  run fails for lack of memory (an OOM, or the engine's fit check refusing it): below the
  10 % margin a wrong ``fits`` would show.

And ``auto`` picks a candidate that runs at a capacity where module strict fails.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from diffusion_offload import Omni, SamplingParams
from diffusion_offload.models.fit import FitError
from diffusion_offload.planner.model import load_plan_model
from diffusion_offload.planner.plan import plan_model, resolve_request
from diffusion_offload.testing import fake_accelerator, tiny_pipelines

KINDS = ("wan2.2", "flux", "sd3", "qwen-image")  # wan2.1: the same program as wan2.2
# the candidates every tiny kind has (layer rows when layer mode exists)
NAMES = ("all resident", "module dit+text_encoder", "module dit", "module text_encoder",
         "module dit+text_encoder + budget",
         "layer dit+text_encoder k=0", "layer dit+text_encoder k=max",
         "layer dit+text_encoder + budget")
MARGIN = 1.10


def _prompt(kind: str) -> dict:
    # Qwen-Image's encoder reads the prompt's own length (the plan assumes the longest,
    # 1024 + 34 template tokens): a prompt long enough to be truncated to it
    words = "a photo of a cat " * (400 if kind == "qwen-image" else 1)
    return {"prompt": words.strip(), "negative_prompt": "blurry"}


def _shape(kind: str) -> dict:
    return {"height": 32, "width": 32, "num_frames": 5 if kind.startswith("wan") else None,
            "steps": 2}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[tuple[str, int | None], str] = {}

    def get(kind: str, num_layers: int | None = None) -> str:
        if (kind, num_layers) not in made:
            path = tmp_path_factory.mktemp(f"tiny-{kind}-{num_layers}")
            tiny_pipelines.save(kind, path, num_layers=num_layers)
            made[(kind, num_layers)] = str(path)
        return made[(kind, num_layers)]

    return get


@pytest.fixture(scope="module")
def plans(folders):
    cache: dict = {}

    def get(kind: str, device_memory: int, num_layers: int | None = None):
        key = (kind, num_layers)
        if key not in cache:
            pm = load_plan_model(folders(kind, num_layers))
            shape = _shape(kind)
            cache[key] = (pm, resolve_request(pm, shape["height"], shape["width"],
                                              shape["num_frames"], shape["steps"]))
        pm, request = cache[key]
        return plan_model(pm, request, device_memory, device_kind="fakegpu")

    return get


def _row(rows, name: str):
    if name == "layer dit+text_encoder k=max":
        layer = [r for r in rows if r.name.startswith("layer") and " k=" in r.name
                 and not r.name.endswith("k=0")]
        return layer[-1] if layer else None
    return next((r for r in rows if r.name == name), None)


def _run(folder: str, kind: str, config: dict, capacity: int, requests: int) -> int:
    """Run ``requests`` requests of ``Omni(folder, **config)`` (a row's ``config``) at
    ``capacity`` bytes; return the measured peak (bytes).

    Raises:
        torch.OutOfMemoryError, FitError: the device was too small.
    """
    gc.collect()
    assert fake_accelerator.stats()["allocated_bytes"] == 0, "a previous engine left device memory"
    fake_accelerator.set_capacity(capacity)
    fake_accelerator.reset_stats()
    shape = _shape(kind)
    params = SamplingParams(height=shape["height"], width=shape["width"],
                            num_frames=shape["num_frames"], num_inference_steps=shape["steps"])
    engine = Omni(folder, **config, device="fakegpu", progress=False)
    try:
        for _ in range(requests):
            engine.generate(_prompt(kind), params)
        return fake_accelerator.stats()["peak_bytes"]
    finally:
        engine.close()
        del engine
        gc.collect()
        fake_accelerator.set_capacity(None)


@pytest.mark.slow  # 32 runs of 2-3 requests: in .ci/run, not the README's command
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_predicted_peak_bounds_the_measured_one(kind, name, folders, plans, fake_device, caplog):
    probe = _row(plans(kind, 1 << 40), name)
    assert probe is not None, f"{kind}: no row {name!r}"
    rows = plans(kind, probe.peak_bytes)
    row = next(r for r in rows if r.name == probe.name)
    assert row.fits and row.peak_bytes == probe.peak_bytes
    # the plan is the steady state: what a request leaves on the device (Qwen-Image's
    # rotary tables, moved there by the DiT's first forward) is there from the second
    # request on; a layer budget keeps its blocks from the second request on: steady by
    # the third
    requests = 3 if name == "layer dit+text_encoder + budget" else 2
    measured = _run(folders(kind), kind, row.config, row.peak_bytes, requests=requests)
    assert measured <= row.peak_bytes, (kind, name, measured, row.peak_bytes)
    assert row.peak_bytes <= MARGIN * measured, (kind, name, measured, row.peak_bytes)

    too_small = int(row.peak_bytes / MARGIN) - 1
    small = next((r for r in plans(kind, too_small) if r.name == row.name), None)
    if small is not None and small.fits:
        # the budget follows the device: at the smaller device the plan picks a smaller one
        assert "device_memory_budget" in small.config
        assert small.config["device_memory_budget"] < row.config["device_memory_budget"]
        measured = _run(folders(kind), kind, small.config, too_small, requests=requests)
        assert measured <= small.peak_bytes
        return
    if row.config["diffusion_offload_config"] and row.config["diffusion_offload_config"]["mode"] == "layer":
        # layer mode recovers from an out-of-memory error by dropping the prefetched block
        # (streamer.py): below the plan it runs only that way, never as planned
        with caplog.at_level(logging.INFO, logger="diffusion_offload"):
            try:
                _run(folders(kind), kind, row.config, too_small, requests=requests)
            except (torch.OutOfMemoryError, FitError):
                return
        retried = [r for r in caplog.records if "retrying without prefetch" in r.getMessage()]
        assert retried, (kind, name, "ran below the plan with prefetch")
        return
    with pytest.raises((torch.OutOfMemoryError, FitError)):
        _run(folders(kind), kind, row.config, too_small, requests=requests)


@pytest.mark.parametrize("kind", ["wan2.2", "qwen-image"])
def test_back_to_back_requests_stay_under_the_prediction(kind, folders, plans, fake_device):
    # what a request leaves allocated (the scheduler's last outputs, rotary caches) is
    # there during the next one: the prediction includes it
    row = _row(plans(kind, 1 << 40), "module dit+text_encoder")
    measured = _run(folders(kind), kind, row.config, row.peak_bytes, requests=2)
    assert measured <= row.peak_bytes <= MARGIN * measured


def test_auto_runs_where_module_strict_fails(folders, plans, fake_device, caplog):
    # SD3 with 8 DiT blocks: its denoising segment holds the whole DiT under module mode
    # but only the trunk and two blocks under layer mode
    kind, layers = "sd3", 8
    probe = plans(kind, 1 << 40, layers)
    strict = _row(probe, "module dit+text_encoder")
    capacity = min(r.peak_bytes for r in probe)
    assert capacity < strict.peak_bytes  # so at ``capacity`` the plan says strict does not fit
    folder = folders(kind, layers)
    with pytest.raises((torch.OutOfMemoryError, FitError)):
        _run(folder, kind, strict.config, capacity, requests=1)

    gc.collect()
    fake_accelerator.set_capacity(capacity)
    fake_accelerator.reset_stats()
    shape = _shape(kind)
    with caplog.at_level(logging.INFO, logger="diffusion_offload"):
        engine = Omni(folder, "auto", device="fakegpu", progress=False,
                      plan_shape={"height": 32, "width": 32, "num_inference_steps": 2})
    try:
        picked = engine.plan_choice
        assert picked is not None and picked.name.startswith("layer")
        assert engine.config.mode == "layer"
        said = [r.getMessage() for r in caplog.records if "auto picked" in r.getMessage()]
        assert len(said) == 1 and picked.name in said[0]
        engine.generate(_prompt(kind), SamplingParams(height=32, width=32,
                                                      num_inference_steps=shape["steps"]))
        assert fake_accelerator.stats()["peak_bytes"] <= capacity
    finally:
        engine.close()
        fake_accelerator.set_capacity(None)


def test_auto_says_the_smallest_need_when_nothing_fits(folders, plans, fake_device):
    kind = "wan2.2"
    smallest = min(r.peak_bytes for r in plans(kind, 1 << 40))
    fake_accelerator.set_capacity(smallest - 1)
    try:
        with pytest.raises(FitError) as err:
            Omni(folders(kind), "auto", device="fakegpu", progress=False,
                 plan_shape={"height": 32, "width": 32, "num_frames": 5,
                             "num_inference_steps": 2})
    finally:
        fake_accelerator.set_capacity(None)
    message = str(err.value)
    assert "\n" not in message
    assert "no candidate fits" in message and f"({smallest} bytes)" in message
    assert f"({smallest - 1} bytes)" in message
