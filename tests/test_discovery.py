"""Component roles for every diffusers pipeline (issue 25, items 1-4).

The role table covers every module component name of every pipeline class diffusers
exports; renamed denoisers are DiTs, VQ/audio decoders are VAEs, adapters move with the
DiT group; DiT + VAE pipelines offload with ``components=["dit"]``; the legacy switch
offloads what exists; an explicit selection that cannot be honoured still raises.
"""

from __future__ import annotations

import inspect
import typing
import warnings

import pytest
import torch
from torch import nn

from diffusion_offload import ModelLevelOffloadBackend, parse_diffusion_offload_config
from diffusion_offload.core.discovery import DIFFUSERS_ROLE_TABLE, ROLES, diffusers_role
from diffusion_offload.testing import tiny_families

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def _module_types(annotation: object) -> bool:
    """Whether ``annotation`` (possibly a Union / Optional / list[...]) names an nn.Module class."""
    if isinstance(annotation, type):
        return issubclass(annotation, nn.Module)
    return any(_module_types(a) for a in typing.get_args(annotation))


def _diffusers_module_components() -> dict[str, list[str]]:
    """name -> pipeline classes, for every ``__init__`` argument typed as an nn.Module
    (``ModelMixin``, ``PreTrainedModel``...) of every ``*Pipeline`` class diffusers exports."""
    import diffusers

    out: dict[str, list[str]] = {}
    for attr in dir(diffusers):
        if not attr.endswith("Pipeline"):
            continue
        cls = getattr(diffusers, attr)
        if not inspect.isclass(cls):
            continue
        hints = typing.get_type_hints(cls.__init__)
        for name in list(inspect.signature(cls.__init__).parameters)[1:]:
            if _module_types(hints.get(name)):
                out.setdefault(name, []).append(attr)
    return out


@pytest.mark.slow  # imports every diffusers pipeline module: ~5 s
def test_every_diffusers_pipeline_component_has_a_role():
    components = _diffusers_module_components()
    assert len(components) > 40 and "unet" in components and "controlnet" in components
    unknown = {name: classes[:3] for name, classes in components.items() if diffusers_role(name) is None}
    assert unknown == {}


def test_role_table_names_denoisers_decoders_and_adapters():
    assert all(role in ROLES for _, role in DIFFUSERS_ROLE_TABLE)
    expected = {
        "prior": "dit", "prior_prior": "dit", "decoder": "dit", "latent_upsampler": "dit", "transformer_2": "dit",
        "movq": "vae", "vqgan": "vae", "vqvae": "vae", "vocoder": "vae", "audio_vae": "vae",
        "controlnet": "adapter", "controlnet_2": "adapter", "adapter": "adapter", "brushnet": "adapter",
        "text_encoder_3": "text_encoder", "prior_text_encoder": "text_encoder",
        "image_encoder": "encoder", "prior_image_encoder": "encoder", "context_encoder": "encoder",
    }
    assert {n: diffusers_role(n) for n in expected} == expected


@pytest.fixture(scope="module")
def reference():
    """family -> its all-resident output on the fake device."""
    from diffusion_offload.testing import fake_accelerator

    device = fake_accelerator.install()
    cache: dict[str, torch.Tensor] = {}

    def get(family: str) -> torch.Tensor:
        if family not in cache:
            cache[family] = tiny_families.run(family, tiny_families.build(family).to(device))
        return cache[family]

    return get


def _on_device(module: nn.Module, device: torch.device) -> bool:
    return any(p.device.type == device.type for p in module.parameters())


def _nbytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def test_adapter_loaded_and_evicted_with_the_dit_group(fake_device, reference):
    pipe = tiny_families.build("sd-controlnet")
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit", "text_encoder"]}, fake_device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no "no known role" warning
        backend.enable(pipe)
    assert backend.components["controlnet"].role == "adapter" and backend.components["controlnet"].selected
    assert not _on_device(pipe.controlnet, fake_device)  # rests on the host with the unet
    start = backend.stats.h2d_bytes
    seen: dict[str, set[tuple[bool, bool]]] = {"text": set(), "controlnet": set(), "unet": set(), "vae": set()}

    def probe(stage: str):
        def hook(*_: object) -> None:
            seen[stage].add((_on_device(pipe.controlnet, fake_device), _on_device(pipe.unet, fake_device)))
        return hook

    handles = [pipe.text_encoder.get_input_embeddings().register_forward_pre_hook(probe("text")),
               pipe.controlnet.conv_in.register_forward_pre_hook(probe("controlnet")),
               pipe.unet.conv_in.register_forward_pre_hook(probe("unet")),
               pipe.vae.decoder.register_forward_pre_hook(probe("vae"))]
    out = tiny_families.run("sd-controlnet", pipe)
    for h in handles:
        h.remove()
    # (controlnet on the device, unet on the device) at each stage
    assert seen == {"text": {(False, False)}, "controlnet": {(True, True)}, "unet": {(True, True)},
                    "vae": {(False, False)}}
    assert float((out - reference("sd-controlnet")).abs().max()) == 0.0
    assert backend.audit() == [] and backend.stats.d2h_bytes == 0
    # one request: the DiT group (unet + controlnet) loaded once; the text encoder rested on the device
    assert backend.stats.h2d_bytes - start == _nbytes(pipe.unet) + _nbytes(pipe.controlnet)


@pytest.mark.parametrize("family, dit, vae", [("kandinsky2.2", "unet", "movq"), ("dit", "transformer", "vae")])
def test_dit_vae_pipeline_offloads_the_dit(fake_device, reference, family, dit, vae):
    pipe = tiny_families.build(family)
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, fake_device)
    backend.enable(pipe)
    assert backend.components[vae].role == "vae" and not _on_device(getattr(pipe, dit), fake_device)
    start = backend.stats.h2d_bytes
    at_decode: list[bool] = []
    handle = getattr(pipe, vae).decoder.register_forward_pre_hook(
        lambda *_: at_decode.append(_on_device(getattr(pipe, dit), fake_device)))
    out = tiny_families.run(family, pipe)
    handle.remove()
    assert at_decode == [False]  # the DiT was evicted before the VAE decoded
    assert float((out - reference(family)).abs().max()) == 0.0
    assert backend.audit() == [] and backend.stats.d2h_bytes == 0
    assert backend.stats.h2d_bytes - start == _nbytes(getattr(pipe, dit))


@pytest.mark.parametrize("family, moved", [
    ("sd-image-variation", ("unet", "image_encoder")),  # no text encoder
    ("kandinsky2.2", ("unet",)),  # no encoder at all
    ("shap-e-img2img", ("prior", "image_encoder")),  # a denoiser named `prior`
])
def test_legacy_switch_offloads_what_exists(fake_device, reference, family, moved):
    pipe = tiny_families.build(family)
    backend = ModelLevelOffloadBackend(parse_diffusion_offload_config(None, enable_cpu_offload=True), fake_device)
    backend.enable(pipe)
    assert sorted(n for n, c in backend.components.items() if c.selected) == sorted(moved)
    out = tiny_families.run(family, pipe)
    assert float((out - reference(family)).abs().max()) == 0.0
    assert backend.audit() == [] and backend.stats.d2h_bytes == 0
    # every selected component moved: its bytes went host -> device
    assert backend.stats.h2d_bytes >= sum(_nbytes(getattr(pipe, n)) for n in moved)


def test_explicit_selection_that_cannot_be_honoured_raises(fake_device):
    from diffusers import DDIMPipeline, DDIMScheduler, UNet2DModel

    pipe = tiny_families.build("sd-image-variation")
    before = {n: p.clone() for n, p in pipe.unet.named_parameters()}
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit", "text_encoder"]}, fake_device)
    with pytest.raises(ValueError, match="components includes 'text_encoder' but the pipeline has no text encoder"):
        backend.enable(pipe)
    assert not backend.is_enabled() and "forward" not in pipe.unet.__dict__
    assert all(p.device.type == "cpu" and torch.equal(p, before[n]) for n, p in pipe.unet.named_parameters())
    unet = UNet2DModel(block_out_channels=(4, 8), norm_num_groups=2, layers_per_block=1, sample_size=8,
                       in_channels=3, out_channels=3, down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))
    ddim = DDIMPipeline(unet=unet, scheduler=DDIMScheduler())  # a DiT alone: nothing evicts it
    with pytest.raises(ValueError, match="needs an encoder or a VAE stage"):
        ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, fake_device).enable(ddim)
    legacy = ModelLevelOffloadBackend(parse_diffusion_offload_config(None, enable_cpu_offload=True), fake_device)
    legacy.enable(ddim)  # the legacy switch never refuses: the unet is offloaded
    assert legacy.components["unet"].selected and not _on_device(unet, fake_device)
    legacy.disable()
