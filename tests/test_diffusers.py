"""Unmodified diffusers pipelines under the offload backend (issue 3 "Must show").

Tiny random-weight pipelines are saved with ``save_pretrained`` and loaded back with
``DiffusionPipeline.from_pretrained``, the code path a real checkpoint takes.
"""

from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from diffusion_offload import ModelLevelOffloadBackend
from diffusion_offload.core.discovery import discover_components
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

FULL = {"mode": "module", "components": ["dit", "text_encoder"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache: dict[str, object] = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = tiny_pipelines.save(kind, tmp_path_factory.mktemp(kind.replace(".", "_")) / "model")
        return cache[kind]

    return get


def _load(path):
    pipe = DiffusionPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe, kind, **overrides):
    kwargs = dict(tiny_pipelines.default_call_kwargs(kind))
    kwargs.update(overrides)
    out = pipe(prompt="a cat on a mat", generator=torch.Generator("cpu").manual_seed(0), output_type="np", **kwargs)
    arr = out.frames if hasattr(out, "frames") else out.images
    return np.asarray(arr, dtype=np.float64)


def _tensors(module):
    return list(module.parameters()) + list(module.buffers())


def _nbytes(module):
    return sum(t.numel() * t.element_size() for t in _tensors(module))


def _on(module, device_type):
    return all(t.device.type == device_type for t in _tensors(module))


def _components(pipe):
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


def _probe(pipe, exclusion: dict[str, set[str]], violations: list, seen: set, extra=None):
    comps = _components(pipe)
    handles = []
    for name, module in comps.items():
        for leaf in module.modules():
            if list(leaf.children()):
                continue

            def hook(mod, args, name=name, module=module):
                seen.add(name)
                if not _on(module, "fakegpu"):
                    violations.append(f"{name} not on the device in its forward")
                for other in exclusion.get(name, ()):
                    if not _on(comps[other], "cpu"):
                        violations.append(f"{other} not on the host while {name} runs")
                if extra is not None:
                    extra(name)

            handles.append(leaf.register_forward_pre_hook(hook))
    return handles


WAN22_EXCLUSION = {
    "transformer": {"transformer_2", "text_encoder"},
    "transformer_2": {"transformer", "text_encoder"},
    "text_encoder": {"transformer", "transformer_2"},
}


def test_wan22_role_map(saved):
    pipe = _load(saved("wan2.2"))
    roles = {c.name: c.role for c in discover_components(pipe)}
    assert roles == {"transformer": "dit", "transformer_2": "dit", "text_encoder": "text_encoder", "vae": "vae"}
    assert pipe.config.boundary_ratio == 0.875


def test_wan22_equal_placement_memory_and_transfers(fake_device, saved):
    path = saved("wan2.2")
    gc.collect()
    base = fa.stats()["allocated_bytes"]  # whatever earlier tests left on the device
    ref_pipe = _load(path).to(fake_device)
    fa.reset_stats()
    resident_start = fa.stats()["allocated_bytes"] - base
    reference = _run(ref_pipe, "wan2.2")
    resident_peak = fa.stats()["peak_bytes"] - base
    all_weights = sum(_nbytes(m) for m in _components(ref_pipe).values())
    assert resident_start == all_weights
    del ref_pipe
    gc.collect()
    assert fa.stats()["allocated_bytes"] == base

    pipe = _load(path)
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    violations: list[str] = []
    seen: set[str] = set()
    _probe(pipe, WAN22_EXCLUSION, violations, seen)
    sizes = {n: _nbytes(m) for n, m in _components(pipe).items()}
    for request in range(3):
        fa.reset_stats()
        before = backend.stats.snapshot()
        out = _run(pipe, "wan2.2")
        delta = backend.stats.since(before)
        assert np.abs(out - reference).max() <= 1e-6, f"request {request + 1}"
        assert delta.d2h_bytes == 0
        if request > 0:  # steady state
            assert delta.h2d_bytes == sizes["text_encoder"] + sizes["transformer"] + sizes["transformer_2"]
        peak = fa.stats()["peak_bytes"] - base
        assert peak < resident_peak
        largest = max(sizes["text_encoder"], sizes["transformer"], sizes["transformer_2"])
        assert peak <= largest + sizes["vae"] + (resident_peak - all_weights)
    assert violations == []
    assert seen == {"transformer", "transformer_2", "text_encoder", "vae"}


def test_wan22_h2d_independent_of_steps(fake_device, saved):
    pipe = _load(saved("wan2.2"))
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    _run(pipe, "wan2.2", num_inference_steps=2)
    per_steps = {}
    for steps in (2, 8):
        before = backend.stats.snapshot()
        _run(pipe, "wan2.2", num_inference_steps=steps)
        per_steps[steps] = backend.stats.since(before)
    assert per_steps[2].h2d_bytes == per_steps[8].h2d_bytes
    assert per_steps[2].loads == per_steps[8].loads == 3
    assert per_steps[8].d2h_bytes == 0


def test_pipeline_on_device_before_enable_ends_with_dits_on_host(fake_device, saved):
    pipe = _load(saved("wan2.2")).to(fake_device)
    ModelLevelOffloadBackend(FULL, fake_device).enable(pipe)
    assert _on(pipe.transformer, "cpu") and _on(pipe.transformer_2, "cpu")
    assert _on(pipe.text_encoder, "fakegpu") and _on(pipe.vae, "fakegpu")


@pytest.mark.parametrize("kind, encoders", [("flux", ["text_encoder", "text_encoder_2"]),
                                            ("sd3", ["text_encoder", "text_encoder_2", "text_encoder_3"])])
def test_multi_text_encoder_pipelines(fake_device, saved, kind, encoders):
    path = saved(kind)
    reference = _run(_load(path).to(fake_device), kind)
    pipe = _load(path)
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    comps = _components(pipe)
    exclusion = {"transformer": set(encoders), **{e: {"transformer"} for e in encoders}}
    together: list[str] = []

    def all_encoders_resident(name):
        if name in encoders and not all(_on(comps[e], "fakegpu") for e in encoders):
            together.append(name)

    violations: list[str] = []
    seen: set[str] = set()
    _probe(pipe, exclusion, violations, seen, extra=all_encoders_resident)
    for _ in range(2):
        assert np.abs(_run(pipe, kind) - reference).max() <= 1e-6
    assert violations == [] and together == []
    assert set(encoders) | {"transformer"} <= seen
    assert backend.stats.d2h_bytes == 0


def _with_extra(path, name, module):
    """The saved Wan pipeline as an instance of a subclass with one more module component."""
    from diffusers import WanPipeline

    base = _load(path)

    class WanWithExtra(WanPipeline):
        pass

    def init(self, tokenizer, text_encoder, vae, scheduler, transformer=None, transformer_2=None,
             boundary_ratio=None, expand_timesteps=False, **extra):
        WanPipeline.__init__(self, tokenizer, text_encoder, vae, scheduler, transformer,
                             transformer_2, boundary_ratio, expand_timesteps)
        self.register_modules(**extra)

    import inspect

    params = list(inspect.signature(init).parameters.values())[:-1]
    params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None))
    init.__signature__ = inspect.Signature(params)
    WanWithExtra.__init__ = init
    WanWithExtra._optional_components = [*WanPipeline._optional_components, name]
    parts = {k: v for k, v in base.components.items()}
    pipe = WanWithExtra(**parts, **{name: module})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_component_roles_override_and_unknown_warning(fake_device, saved):
    pipe = _with_extra(saved("wan2.1"), "extra_head", torch.nn.Linear(4, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        roles = {c.name: c.role for c in discover_components(pipe)}
    messages = [str(w.message) for w in caught if "extra_head" in str(w.message)]
    assert len(messages) == 1 and "component_roles" in messages[0]
    assert roles["extra_head"] == "resident"
    roles = {c.name: c.role for c in discover_components(pipe, {"extra_head": "vae"})}
    assert roles["extra_head"] == "vae"
    with pytest.raises(ValueError, match="not a module component"):
        discover_components(pipe, {"nope": "dit"})
    with pytest.raises(ValueError, match="allowed roles"):
        discover_components(pipe, {"extra_head": "decoder"})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backend = ModelLevelOffloadBackend(FULL, fake_device)
        backend.enable(pipe)
    assert _on(pipe.extra_head, "fakegpu")  # unknown stays resident, never wrong device


def test_image_encoder_is_unselectable_but_evicts_dits(fake_device, saved):
    image_encoder = torch.nn.Linear(8, 8)
    pipe = _with_extra(saved("wan2.1"), "image_encoder", image_encoder)
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    assert not backend.components["image_encoder"].selected
    from diffusion_offload.core.hooks import get_hook

    get_hook(pipe.transformer).activate()  # what the DiT's forward does first
    assert _on(pipe.transformer, "fakegpu") and _on(pipe.text_encoder, "cpu")
    out = image_encoder(torch.ones(1, 8))  # host input moved by the hook
    assert out.device == fake_device
    assert _on(pipe.transformer, "cpu") and _on(image_encoder, "fakegpu")
    from diffusion_offload import parse_diffusion_offload_config

    legacy_pipe = _with_extra(saved("wan2.1"), "image_encoder", torch.nn.Linear(8, 8))
    legacy = ModelLevelOffloadBackend(parse_diffusion_offload_config(None, enable_cpu_offload=True), fake_device)
    legacy.enable(legacy_pipe)
    assert legacy.components["image_encoder"].selected


def test_offload_inside_inference_mode(fake_device, saved):
    path = saved("flux")
    reference = _run(_load(path).to(fake_device), "flux")
    pipe = _load(path)
    backend = ModelLevelOffloadBackend(FULL, fake_device)
    backend.enable(pipe)
    with torch.inference_mode():
        for _ in range(2):
            assert np.abs(_run(pipe, "flux") - reference).max() <= 1e-6
    assert backend.stats.d2h_bytes == 0
    assert not any(p.is_inference() for p in pipe.transformer.parameters())
