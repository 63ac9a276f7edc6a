"""The budget is never exceeded at rest (issue 25 item 7).

With ``device_memory_budget`` at half the pipeline's weight bytes (smaller than one DiT
beside the VAE), resident weights stay at or under the budget right after ``enable()``,
before and after every offloaded stage call and between requests; a stage bigger than the
budget runs over it and is evicted as soon as its call returns. Outputs equal the
all-resident run bit for bit, and ``audit() == []``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
from diffusion_offload.core.policy import BudgetTooSmallError
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines
from diffusion_offload.testing.pipeline_matrix import weight_bytes
from diffusion_offload.testing.pytest_plugin import requires_fake

pytestmark = [requires_fake, pytest.mark.filterwarnings("ignore::FutureWarning")]

ALL = ["dit", "text_encoder"]


def _resident(pipe, device) -> int:
    """Bytes of the pipeline's weights on the fake device now (each tensor once)."""
    seen: dict[int, int] = {}
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            for t in [*module.parameters(), *module.buffers()]:
                if t.device.type == device.type:
                    seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


def _run(pipe, kind: str) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = pipe(prompt="a cat", negative_prompt="blur", output_type="np",
                   generator=torch.Generator("cpu").manual_seed(0), **tiny_pipelines.default_call_kwargs(kind))
    return np.asarray(out[0])


def _watch(pipe, device, seen: list[int]) -> None:
    """Record the resident weight bytes before and after every component module's call
    (outside our offload entry: between stages)."""
    for module in pipe.components.values():
        if isinstance(module, torch.nn.Module):
            module.register_forward_pre_hook(lambda m, a: seen.append(_resident(pipe, device)))
            module.register_forward_hook(lambda m, a, o: seen.append(_resident(pipe, device)))


CASES = [
    ("module", "flux", None),
    pytest.param("layer", "wan2.2", 8, marks=pytest.mark.slow),  # ~12 s
    pytest.param("module", "wan2.1", None, marks=pytest.mark.slow),
    pytest.param("module", "sd3", None, marks=pytest.mark.slow),  # three encoders: ~10 s
    pytest.param("layer", "flux", 8, marks=pytest.mark.slow),  # ~15 s
]


@pytest.mark.parametrize("mode,kind,num_layers", CASES, ids=["module-flux", "layer-wan2.2", "module-wan2.1", "module-sd3", "layer-flux"])
def test_half_the_weights_stays_within_the_budget_at_rest(fake_device, mode, kind, num_layers):
    ref = _run(tiny_pipelines.build(kind, num_layers=num_layers).to(fake_device), kind)
    pipe = tiny_pipelines.build(kind, num_layers=num_layers).to(fake_device)
    budget = weight_bytes(pipe) // 2
    cls = ModelLevelOffloadBackend if mode == "module" else LayerwiseOffloadBackend
    with cls({"mode": mode, "components": ALL}, fake_device, device_memory_budget=budget) as backend:
        backend.enable(pipe)
        assert _resident(pipe, fake_device) <= budget and backend.audit() == []
        seen: list[int] = []
        _watch(pipe, fake_device, seen)
        for _ in range(2):
            before = fa.stats()["h2d_bytes"]
            assert np.abs(_run(pipe, kind) - ref).max() == 0.0
            assert fa.stats()["h2d_bytes"] > before  # something was offloaded and moved back
            assert _resident(pipe, fake_device) <= budget and backend.audit() == []
        assert len(seen) > 4 and max(seen) <= budget, (max(seen), budget)


def test_a_stage_bigger_than_the_budget_runs_then_leaves(fake_device):
    """Flux's transformer alone is larger than half the weights: it runs over the budget,
    and is on the host again as soon as each of its calls returns."""
    pipe = tiny_pipelines.build("flux").to(fake_device)
    budget = weight_bytes(pipe) // 2
    dit = sum(p.numel() * p.element_size() for p in pipe.transformer.parameters())
    with ModelLevelOffloadBackend({"mode": "module", "components": ALL}, fake_device,
                                  device_memory_budget=budget) as backend:
        backend.enable(pipe)
        assert backend.policy.fixed_bytes() + dit > budget  # the stage does not fit
        during: list[int] = []
        pipe.transformer.register_forward_hook(
            lambda m, a, o: during.append(next(m.parameters()).device.type), prepend=False
        )
        inside: list[str] = []
        inner = pipe.transformer.transformer_blocks[0]
        inner.register_forward_pre_hook(lambda m, a: inside.append(next(m.parameters()).device.type))
        _run(pipe, "flux")
        assert inside and set(inside) == {fake_device.type}  # it ran on the device
        assert during and set(during) == {"cpu"}  # evicted when each call returned
        assert backend.audit() == []


def test_a_budget_below_what_always_stays_is_refused(fake_device):
    """Unselected components stay on the device: a budget below them cannot hold at rest."""
    pipe = tiny_pipelines.build("wan2.1")
    fixed = sum(
        p.numel() * p.element_size() for n in ("text_encoder", "vae") for p in getattr(pipe, n).parameters()
    )
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, fake_device,
                                       device_memory_budget=fixed - 1)
    with pytest.raises(BudgetTooSmallError, match=rf"below the smallest workable budget of {fixed} bytes"):
        backend.enable(pipe)
    assert not backend.is_enabled()
