"""Combined pipelines under every mode, request after request (issue 38 item 8).

diffusers' combined pipelines (Kandinsky 2.1 / 2.2 ``...CombinedPipeline`` for text-to-image,
img2img and inpaint; ``StableCascadeCombinedPipeline``) nest a prior pipeline and a decoder
pipeline that share the combined pipeline's components. A prior pipeline holds a prior, a
text encoder and an image encoder, and no VAE that stays resident: under the legacy switch,
a selection with the text encoders, or a budget, every module of it rests on the host
between requests, and diffusers (``DiffusionPipeline.device``, read by
``_execution_device``) then reported the CPU as the device it computes on. Its second
request mixed host timesteps with device outputs: "Expected all tensors to be on the same
device". ``core/backends/execution_device.py`` makes a pipeline whose modules are offloaded
answer the offload device.

The fast tests check that answer (the sub-pipelines, a pipeline built from shared
components, after ``disable()``, a pipeline never offloaded) and run the fastest family
twice under the legacy switch, once more after a ``save_pretrained`` round trip; the slow
sweep runs every combined family of the matrix three times under every mode, each request
bit-equal to the all-resident run.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend, parse_diffusion_offload_config
from diffusion_offload.core.backends.execution_device import follow_offload, offload_device
from diffusion_offload.core.caches import clear_method_caches
from diffusion_offload.core.discovery import diffusers_role
from diffusion_offload.testing import fake_accelerator, tiny_families
from diffusion_offload.testing.pipeline_matrix import FAMILIES, weight_bytes
from diffusion_offload.testing.pytest_plugin import requires_fake

pytestmark = [requires_fake, pytest.mark.filterwarnings("ignore")]

#: the combined families of the compatibility matrix
COMBINED = [name for name, fam in FAMILIES.items() if fam.pipeline.endswith("CombinedPipeline")]

#: mode -> the backend's config and keyword arguments (budgets: ``"half"``, half the weight
#: bytes; ``"half the DiTs"``, every weight byte but half the DiTs': module mode keeps the
#: encoders resident, so the budget leaves them room)
MODES: dict[str, tuple[Any, dict[str, Any]]] = {
    "module": ({"mode": "module", "components": ["dit"]}, {}),
    "module+text_encoder": ({"mode": "module", "components": ["dit", "text_encoder"]}, {}),
    "module-budget": ({"mode": "module", "components": ["dit"]}, {"device_memory_budget": "half the DiTs"}),
    "legacy": (None, {}),
    "legacy-budget": (None, {"device_memory_budget": "half"}),
    "layer": ({"mode": "layer", "components": ["dit"]}, {}),
}

CPU = torch.device("cpu")


def test_every_combined_pipeline_family_is_in_the_matrix():
    assert sorted(COMBINED) == [
        "kandinsky2.1-combined", "kandinsky2.1-img2img-combined", "kandinsky2.1-inpaint-combined",
        "kandinsky2.2-combined", "kandinsky2.2-img2img-combined", "kandinsky2.2-inpaint-combined",
        "stable-cascade",
    ]


def _dit_bytes(pipe: Any) -> int:
    seen: dict[int, int] = {}
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module) and diffusers_role(name) == "dit":
            for t in [*module.parameters(), *module.buffers()]:
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _budget(spec: str, pipe: Any) -> int:
    if spec == "half":
        return weight_bytes(pipe) // 2
    assert spec == "half the DiTs"
    return weight_bytes(pipe) - _dit_bytes(pipe) // 2


def _backend(mode: str, pipe: Any, device: torch.device) -> Any:
    config, kwargs = MODES[mode]
    kwargs = {k: _budget(v, pipe) if k == "device_memory_budget" else v for k, v in kwargs.items()}
    if config is None:
        config = parse_diffusion_offload_config(None, enable_cpu_offload=True)
    cls = LayerwiseOffloadBackend if mode == "layer" else ModelLevelOffloadBackend
    return cls(config, device, **kwargs)


def _quiet(fn: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _run(family: str, pipe: Any) -> np.ndarray:
    return _quiet(lambda: tiny_families.run(family, pipe).numpy())


def _sides(module: torch.nn.Module) -> set[str]:
    return {t.device.type for t in [*module.parameters(), *module.buffers()]}


def _sub_pipelines(pipe: Any) -> list[Any]:
    return [pipe.prior_pipe, pipe.decoder_pipe]


@pytest.fixture(scope="module")
def references() -> dict[str, np.ndarray]:
    """Family -> its all-resident output on the fake device (computed on first use)."""
    return {}


def _reference(references: dict[str, np.ndarray], family: str, device: torch.device) -> np.ndarray:
    if family not in references:
        pipe = tiny_families.build(family).to(device)
        references[family] = _run(family, pipe)
        clear_method_caches(pipe)
    return references[family]


def _no_device_memory_left() -> None:
    gc.collect()
    assert fake_accelerator.stats()["allocated_bytes"] == 0, "an earlier test left device memory"


def test_sub_pipelines_whose_modules_rest_on_the_host_compute_on_the_device(fake_device, references):
    """The legacy switch on Kandinsky 2.2's combined text-to-image: after each request every
    module of the prior pipeline is on the host, and the prior pipeline still answers the
    fake device; both requests equal the all-resident run. After ``disable()`` diffusers'
    own answer is back (the CPU, where those modules are)."""
    _no_device_memory_left()
    family = "kandinsky2.2-combined"
    ref = _reference(references, family, fake_device)
    pipe = tiny_families.build(family).to(fake_device)
    backend = _backend("legacy", pipe, fake_device)
    backend.enable(pipe)
    prior = pipe.prior_pipe
    prior_modules = {"prior_prior": prior.prior, "prior_text_encoder": prior.text_encoder,
                     "prior_image_encoder": prior.image_encoder}
    try:
        assert sorted(n for n, c in backend.components.items() if c.selected) == sorted(prior_modules) + ["unet"]
        for request in range(2):
            out = _run(family, pipe)
            assert np.array_equal(out, ref), request
            assert backend.audit() == []
            # the strict rule: every selected module rests on the host, the VAE on the device
            assert {n: _sides(m) for n, m in prior_modules.items()} == dict.fromkeys(prior_modules, {"cpu"})
            assert _sides(pipe.unet) == {"cpu"} and _sides(pipe.movq) == {"fakegpu"}
            for sub in (pipe, *_sub_pipelines(pipe)):
                assert sub._execution_device == fake_device and sub.device == fake_device
    finally:
        backend.disable()
    assert prior._execution_device == CPU and prior.device == CPU
    assert pipe.decoder_pipe._execution_device == fake_device  # its movq stays on the device
    assert offload_device(prior) is None


def test_a_pipeline_built_from_offloaded_components_follows_the_offload(fake_device):
    """The answer comes from the shared modules, not from a list of pipelines: a prior
    pipeline built from the combined pipeline's components, all of them on the host,
    answers the offload device while they are offloaded; a pipeline with modules of its
    own keeps diffusers' answer."""
    from diffusers import KandinskyV22PriorPipeline

    from diffusion_offload import offload_component

    _no_device_memory_left()
    pipe = tiny_families.build("kandinsky2.2-combined")
    other = tiny_families.build("kandinsky2.2-combined").prior_pipe  # same classes, its own modules
    backend = _backend("legacy", pipe, fake_device)
    backend.enable(pipe.to(fake_device))
    try:
        with offload_component(pipe.unet):  # a DiT evicts the encoders; leaving evicts it
            pass
        built = KandinskyV22PriorPipeline(**pipe.prior_pipe.components)
        assert {_sides(m) == {"cpu"} for m in (built.prior, built.text_encoder, built.image_encoder)} == {True}
        assert built._execution_device == fake_device and built.device == fake_device
        assert offload_device(built) == fake_device
        assert other._execution_device == CPU and offload_device(other) is None
    finally:
        backend.disable()
    assert offload_device(built) is None and built._execution_device == CPU


def test_follow_offload_changes_only_diffusers_pipelines():
    """``follow_offload`` installs once and only for diffusers pipelines; a pipeline of
    another kind reports False and gets nothing."""
    from diffusers import DiffusionPipeline

    class NotDiffusers:
        def __init__(self) -> None:
            self.model = torch.nn.Linear(2, 2)

    assert follow_offload(NotDiffusers()) is False
    pipe = tiny_families.build("kandinsky2.2-combined")
    assert follow_offload(pipe) is True and follow_offload(pipe.prior_pipe) is True
    for name in ("device", "_execution_device"):
        prop = DiffusionPipeline.__dict__[name]
        assert isinstance(prop, property)
        original = prop.fget._diffusion_offload_original
        assert not hasattr(original.fget, "_diffusion_offload_original")  # wrapped once
    assert pipe.prior_pipe._execution_device == CPU and offload_device(pipe) is None


def test_a_combined_pipeline_loaded_back_runs_twice_under_the_legacy_switch(fake_device, tmp_path):
    """Kandinsky 2.1's combined text-to-image (``MultilingualCLIP`` and its XLM-R tokenizer
    too), saved with ``save_pretrained`` and loaded back: two requests under the legacy
    switch, each equal to the loaded pipeline's all-resident run."""
    from diffusers import DiffusionPipeline

    _no_device_memory_left()
    family = "kandinsky2.1-combined"
    tiny_families.build(family).save_pretrained(tmp_path, safe_serialization=True)

    def load() -> Any:
        pipe = _quiet(lambda: DiffusionPipeline.from_pretrained(tmp_path))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    loaded = load()
    assert type(loaded).__name__ == "KandinskyCombinedPipeline"
    assert type(loaded.text_encoder).__name__ == "MultilingualCLIP"
    ref = _run(family, loaded.to(fake_device))
    del loaded
    pipe = load().to(fake_device)
    backend = _backend("legacy", pipe, fake_device)
    backend.enable(pipe)
    try:
        for request in range(2):
            assert np.array_equal(_run(family, pipe), ref), request
            assert backend.audit() == []
            assert _sides(pipe.prior_prior) == _sides(pipe.prior_text_encoder) == {"cpu"}
    finally:
        backend.disable()


def test_the_stable_cascade_prior_alone_runs_twice_under_a_budget(fake_device):
    """``StableCascadePriorPipeline`` on its own (the combined family's prior pipeline) under
    the legacy switch with a budget of half its weight bytes: its modules leave the device
    between requests, and each request's image embeddings equal the all-resident ones."""
    _no_device_memory_left()

    def prior() -> Any:
        return tiny_families.build("stable-cascade").prior_pipe

    def run(pipe: Any) -> torch.Tensor:
        return _quiet(lambda: pipe(prompt="a cat", negative_prompt="blurry", height=128, width=128,
                                   num_inference_steps=2, guidance_scale=4.0, output_type="pt",
                                   generator=torch.Generator("cpu").manual_seed(0)).image_embeddings)

    ref = run(prior().to(fake_device)).cpu()
    pipe = prior().to(fake_device)
    pipe.set_progress_bar_config(disable=True)
    backend = _backend("legacy-budget", pipe, fake_device)
    backend.enable(pipe)
    try:
        assert backend.policy.budget == weight_bytes(pipe) // 2
        for request in range(2):
            assert torch.equal(run(pipe).cpu(), ref), request
            assert backend.audit() == []
            assert pipe._execution_device == fake_device
    finally:
        backend.disable()


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", COMBINED)
def test_combined_pipeline_runs_request_after_request(fake_device, references, family, mode):
    """Three requests of each combined family under each mode, each bit-equal to the
    all-resident run, ``audit() == []`` after each, every pipeline (the combined one and
    its prior and decoder pipelines) computing on the fake device, and under the strict
    rule every selected module back on the host between requests."""
    _no_device_memory_left()
    ref = _reference(references, family, fake_device)
    pipe = tiny_families.build(family).to(fake_device)
    backend = _backend(mode, pipe, fake_device)
    _quiet(lambda: backend.enable(pipe))
    strict = mode in ("module", "module+text_encoder", "legacy")
    try:
        selected = sorted(n for n, c in backend.components.items() if c.selected)
        assert selected
        for request in range(3):
            out = _run(family, pipe)
            assert np.array_equal(out, ref), request
            assert backend.audit() == []
            for sub in (pipe, *_sub_pipelines(pipe)):
                assert sub._execution_device == fake_device
            if strict:
                assert {n: _sides(pipe.components[n]) for n in selected} == dict.fromkeys(selected, {"cpu"})
    finally:
        backend.disable()
        clear_method_caches(pipe)
