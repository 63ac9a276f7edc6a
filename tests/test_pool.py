"""Several models on one device (issue 35): ``sleep``/``wake`` of a sleepable backend and
``ModelPool``. Outputs equal each model run alone, the device holds only the running
model's weights, and no unmodified weight goes device-to-host."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.engine import ModelPool, ModelSpec, Omni, SamplingParams
from diffusion_offload.engine.pool import UnknownModelError
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

KINDS = ("wan2.2", "wan2.2-i2v", "flux")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pool")
    return {kind: tiny_pipelines.save(kind, root / kind) for kind in KINDS}


def _picture() -> Image.Image:
    x = np.arange(32, dtype=np.int64) * 8
    return Image.fromarray(np.stack([np.add.outer(x, x) % 256] * 3, axis=-1).astype(np.uint8))


def _request(kind: str, seed: int) -> tuple[object, SamplingParams]:
    kw = tiny_pipelines.default_call_kwargs(kind)
    params = SamplingParams(height=kw["height"], width=kw["width"], num_frames=kw.get("num_frames"),
                            num_inference_steps=kw["num_inference_steps"], seed=seed)
    prompt: object = f"a cat {seed}"
    if kind == "wan2.2-i2v":
        prompt = {"prompt": prompt, "image": _picture()}
    return prompt, params


def _pixels(out) -> np.ndarray:
    if out.frames:
        return np.stack([np.asarray(f) for f in out.frames[0]])
    return np.stack([np.asarray(i) for i in out.images])


def _weights_on_device(engine: Omni) -> int:
    return sum(t.numel() * t.element_size()
               for _, module in engine.pipeline.components.items() if isinstance(module, torch.nn.Module)
               for t in [*module.parameters(), *module.buffers()] if t.device.type != "cpu")


@pytest.mark.parametrize("mode", ["module", "layer"])
def test_sleep_empties_the_device_with_no_d2h_and_wake_runs_equal(mode, dirs, fake_device):
    kind = "wan2.2"
    prompt, params = _request(kind, 3)
    with Omni(str(dirs[kind]), None, device="fakegpu", progress=False) as alone:
        want = _pixels(alone.generate(prompt, params)[0])
    config = {"mode": mode, "components": ["dit", "text_encoder"] if mode == "module" else ["dit"]}
    with Omni(str(dirs[kind]), config, device="fakegpu", progress=False, sleepable=True) as engine:
        assert np.array_equal(_pixels(engine.generate(prompt, params)[0]), want)
        d2h = engine.stats.d2h_bytes
        assert _weights_on_device(engine) > 0
        freed = engine.sleep()
        assert engine.asleep and freed > 0
        assert _weights_on_device(engine) == 0 == engine.backend.device_weight_bytes()
        assert engine.stats.d2h_bytes == d2h  # nothing written back: zero D2H
        assert engine.backend.audit() == []
        assert engine.sleep() == 0  # idempotent
        out = engine.generate(prompt, params)[0]  # wakes by itself
        assert not engine.asleep and np.array_equal(_pixels(out), want)
        assert engine.backend.audit() == [] and engine.stats.d2h_bytes == d2h


def test_sleep_needs_a_sleepable_backend(fake_device):
    pipe = tiny_pipelines.build("wan2.1", 0)
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, fake_device)
    with pytest.raises(RuntimeError, match="sleepable=True"):
        backend.sleep()  # not enabled
    backend.enable(pipe)
    try:
        with pytest.raises(RuntimeError, match="sleepable=True"):
            backend.sleep()
    finally:
        backend.disable()


def test_a_write_made_while_awake_is_kept_across_a_sleep(fake_device):
    """The VAE rests on the device; a write into it there is written back at sleep (its
    bytes counted in d2h_bytes) and is what the model has after waking."""
    pipe = tiny_pipelines.build("wan2.1", 0)
    backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device, sleepable=True)
    backend.enable(pipe)
    try:
        w = next(pipe.vae.parameters())
        assert w.device == fake_device
        with torch.no_grad():
            w.data.add_(1.0)
        want = w.detach().cpu().clone()
        backend.sleep()
        assert w.device.type == "cpu" and torch.equal(w.detach(), want)
        assert backend.stats.d2h_bytes == w.numel() * w.element_size()
        backend.wake()
        assert w.device == fake_device and torch.equal(w.detach().cpu(), want)
        assert backend.audit() == []
    finally:
        backend.disable()


def test_a_pool_takes_turns_on_one_device_equal_to_each_model_alone(dirs, fake_device):
    specs = [ModelSpec(kind, str(dirs[kind])) for kind in KINDS]
    want = {}
    for kind in KINDS:
        with Omni(str(dirs[kind]), None, device="fakegpu", progress=False) as alone:
            want[kind] = [_pixels(alone.generate(*_request(kind, seed))[0]) for seed in (1, 2)]
        gc.collect()
    order = ["flux", "flux", "wan2.2", "wan2.2-i2v", "flux", "wan2.2", "wan2.2"]
    seen: list[str] = []
    with ModelPool(specs, device="fakegpu", progress=False) as pool:
        assert [e.asleep for e in pool.engines.values()] == [True] * 3  # all start on the host
        pool.listeners.append(lambda model, seconds: seen.append(model))
        d2h = {k: e.stats.d2h_bytes for k, e in pool.engines.items()}
        for i, kind in enumerate(order):
            seed = 1 + i % 2
            out = pool.generate(kind, *_request(kind, seed))[0]
            assert np.array_equal(_pixels(out), want[kind][seed - 1]), (i, kind)
            for other, engine in pool.engines.items():  # only the running model on the device
                assert (_weights_on_device(engine) > 0) == (other == kind), (i, other)
        assert {k: e.stats.d2h_bytes for k, e in pool.engines.items()} == d2h
        # a swap at every change of model in execution order (the first request included)
        changes = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
        assert seen == changes
        info = {m["id"]: m for m in pool.describe()}
        assert {k: (m["requests"], m["swaps"]) for k, m in info.items()} == {
            k: (order.count(k), changes.count(k)) for k in KINDS}
        assert info["wan2.2"]["kind"] == "video" and info["flux"]["kind"] == "image"
        assert info["wan2.2"]["awake"] and info["wan2.2"]["device_bytes"] > 0
        assert info["flux"]["device_bytes"] == 0 and info["flux"]["host_bytes"] > 0
        assert pool.release() > 0
        assert all(_weights_on_device(e) == 0 for e in pool.engines.values())
        out = pool.generate("flux", *_request("flux", 1))[0]
        assert np.array_equal(_pixels(out), want["flux"][0])
        with pytest.raises(UnknownModelError, match="served ids: wan2.2, wan2.2-i2v, flux"):
            pool.generate("sdxl", "x")
    assert fa.stats()["races_detected"] == 0


def test_a_pool_shares_one_host_budget(dirs, fake_device):
    """Each model gets a part of the host budget proportional to its stored bytes; their
    host copies together stay within it, the rest on disk."""
    specs = [ModelSpec(kind, str(dirs[kind])) for kind in ("wan2.2", "flux")]
    with ModelPool(specs, device="fakegpu", progress=False) as free:
        held = sum(e.stats.pinned_total_bytes + e.stats.pageable_host_bytes for e in free.engines.values())
    budget = held // 2
    with ModelPool(specs, device="fakegpu", progress=False, host_memory_budget=budget) as pool:
        parts = [e.host_memory_budget for e in pool.engines.values()]
        assert sum(parts) == budget and all(p > 0 for p in parts)
        for kind in ("wan2.2", "flux", "wan2.2"):
            pool.generate(kind, *_request(kind, 1))
        used = sum(e.stats.pinned_total_bytes + e.stats.pageable_host_bytes + e.stats.cow_bytes
                   for e in pool.engines.values())
        assert used <= budget
        assert all(m["disk_bytes"] > 0 for m in pool.describe())


def test_a_pool_refuses_repeated_ids_and_no_model():
    with pytest.raises(ValueError, match="repeated: \\['a'\\]"):
        ModelPool([ModelSpec("a", "x"), ModelSpec("a", "y")])
    with pytest.raises(ValueError, match="at least one model"):
        ModelPool([])
    with pytest.raises(ValueError, match="model id must be"):
        ModelSpec(" a", "x")
