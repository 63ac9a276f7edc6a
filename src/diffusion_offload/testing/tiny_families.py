"""Tiny random pipelines of diffusers families beyond ``tiny_pipelines``' five kinds.

Each family is built offline in well under a second (our own CLIP tokenizer from
``tiny_tokenizers``, random weights seeded per component) and comes with a fast call:
``build(name) -> pipe`` and ``run(name, pipe) -> torch.Tensor`` (float64 on the host, the
pipeline's ``output_type="np"`` images, or its latents where the pipeline decodes with a
non-``forward`` renderer). Shapes: images ``(1, H, W, 3)`` with H, W in {32, 64}.

Families (``FAMILIES``):

- ``"sd-controlnet"``: ``StableDiffusionControlNetPipeline`` (unet + controlnet, CLIP text
  encoder, VAE): an adapter in the denoising loop.
- ``"sd-image-variation"``: ``StableDiffusionImageVariationPipeline`` (unet, CLIP image
  encoder, VAE): no text encoder.
- ``"kandinsky2.2"``: ``KandinskyV22Pipeline`` (unet + ``movq``): a DiT and a VQ decoder,
  no encoder stage.
- ``"dit"``: ``DiTPipeline`` (class-conditional ``DiTTransformer2DModel`` + VAE): no encoder
  stage.
- ``"shap-e-img2img"``: ``ShapEImg2ImgPipeline`` (``prior``, CLIP image encoder,
  ``shap_e_renderer``); ``run`` returns the latents.
- ``"pixart-sigma"``: ``PixArtSigmaPipeline`` (``PixArtTransformer2DModel``, T5 text
  encoder with our T5 tokenizer, VAE).
- ``"chroma"``: ``ChromaPipeline`` (``ChromaTransformer2DModel``, T5 text encoder, the
  16-channel VAE of ``tiny_pipelines``' Flux).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import tiny_image_families, tiny_video_families
from .tiny_image_families import _sd_vae
from .tiny_tokenizers import clip_tokenizer, t5_tokenizer

__all__ = ["FAMILIES", "build", "run"]


def _seeded(factory: Callable[[], Any]) -> Any:
    torch.manual_seed(0)
    return factory()


def _sd_unet(cross_attention_dim: int = 32):
    from diffusers import UNet2DConditionModel

    return _seeded(lambda: UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=2, sample_size=32, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=cross_attention_dim, norm_num_groups=1,
    ))


def _clip_vision(cls_name: str, hidden: int, patch: int):
    import transformers

    config = transformers.CLIPVisionConfig(
        hidden_size=hidden, projection_dim=hidden, intermediate_size=37, layer_norm_eps=1e-05,
        num_attention_heads=2, num_hidden_layers=2, image_size=32, patch_size=patch,
    )
    return _seeded(lambda: getattr(transformers, cls_name)(config).eval())


def _build_sd_controlnet():
    from diffusers import ControlNetModel, DDIMScheduler, StableDiffusionControlNetPipeline
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = clip_tokenizer()
    controlnet = _seeded(lambda: ControlNetModel(
        block_out_channels=(4, 8), layers_per_block=2, in_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), cross_attention_dim=32,
        conditioning_embedding_out_channels=(16, 32), norm_num_groups=1,
    ))
    text_encoder = _seeded(lambda: CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
    )).eval())
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              clip_sample=False, set_alpha_to_one=False)
    return StableDiffusionControlNetPipeline(
        vae=_sd_vae(), text_encoder=text_encoder, tokenizer=tokenizer, unet=_sd_unet(), controlnet=controlnet,
        scheduler=scheduler, safety_checker=None, feature_extractor=None, image_encoder=None,
        requires_safety_checker=False,
    )


def _run_sd_controlnet(pipe: Any) -> Any:
    image = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    return pipe(prompt="a squirrel", negative_prompt="blurry", image=image, num_inference_steps=2,
                guidance_scale=6.0, generator=torch.Generator().manual_seed(0), output_type="np").images


def _build_sd_image_variation():
    from diffusers import PNDMScheduler, StableDiffusionImageVariationPipeline
    from transformers import CLIPImageProcessor

    return StableDiffusionImageVariationPipeline(
        vae=_sd_vae(), image_encoder=_clip_vision("CLIPVisionModelWithProjection", 32, 4), unet=_sd_unet(),
        scheduler=PNDMScheduler(skip_prk_steps=True), safety_checker=None,
        feature_extractor=CLIPImageProcessor(crop_size=32, size=32), requires_safety_checker=False,
    )


def _run_sd_image_variation(pipe: Any) -> Any:
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return pipe(image=image, num_inference_steps=2, guidance_scale=6.0, height=32, width=32,
                generator=torch.Generator().manual_seed(0), output_type="np").images


def _build_kandinsky22():
    from diffusers import DDIMScheduler, KandinskyV22Pipeline, UNet2DConditionModel, VQModel

    unet = _seeded(lambda: UNet2DConditionModel(
        in_channels=4, out_channels=8, addition_embed_type="image", block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", encoder_hid_dim=16, encoder_hid_dim_type="image_proj",
        cross_attention_dim=16, attention_head_dim=4, resnet_time_scale_shift="scale_shift",
        class_embed_type=None, norm_num_groups=8,
    ))
    movq = _seeded(lambda: VQModel(
        block_out_channels=[32, 64], down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
        in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8, norm_type="spatial",
        num_vq_embeddings=12, out_channels=3, up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"],
        vq_embed_dim=4,
    ))
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=0.00085,
                              beta_end=0.012, clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    return KandinskyV22Pipeline(unet=unet, scheduler=scheduler, movq=movq)


def _run_kandinsky22(pipe: Any) -> Any:
    g = torch.Generator().manual_seed(0)
    embeds, negative = torch.randn(1, 16, generator=g), torch.randn(1, 16, generator=g)
    return pipe(image_embeds=embeds, negative_image_embeds=negative, height=32, width=32, num_inference_steps=2,
                guidance_scale=4.0, generator=torch.Generator().manual_seed(0), output_type="np").images


def _build_dit():
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    transformer = _seeded(lambda: DiTTransformer2DModel(
        sample_size=4, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=2,
        in_channels=4, out_channels=8, num_embeds_ada_norm=1000, norm_type="ada_norm_zero", norm_elementwise_affine=False,
    ))
    return DiTPipeline(transformer=transformer, vae=_sd_vae(), scheduler=DDIMScheduler())


def _run_dit(pipe: Any) -> Any:
    return pipe(class_labels=[1], num_inference_steps=2, guidance_scale=4.0,
                generator=torch.Generator().manual_seed(0), output_type="np").images


def _build_shap_e_img2img():
    from diffusers import HeunDiscreteScheduler, PriorTransformer, ShapEImg2ImgPipeline
    from diffusers.pipelines.shap_e import ShapERenderer
    from transformers import CLIPImageProcessor

    prior = _seeded(lambda: PriorTransformer(
        num_attention_heads=2, attention_head_dim=16, embedding_dim=16, num_embeddings=32, embedding_proj_dim=16,
        time_embed_dim=64, num_layers=1, clip_embed_dim=32, additional_embeddings=0, time_embed_act_fn="gelu",
        norm_in_type="layer", embedding_proj_norm_type="layer", encoder_hid_proj_type=None, added_emb_type=None,
    ))
    renderer = _seeded(lambda: ShapERenderer(
        param_shapes=((8, 93), (8, 8), (8, 8), (8, 8)), d_latent=16, d_hidden=8, n_output=12,
        background=(0.1, 0.1, 0.1),
    ))
    scheduler = HeunDiscreteScheduler(beta_schedule="exp", num_train_timesteps=1024, prediction_type="sample",
                                      use_karras_sigmas=True, clip_sample=True, clip_sample_range=1.0)
    return ShapEImg2ImgPipeline(
        prior=prior, image_encoder=_clip_vision("CLIPVisionModel", 16, 1),
        image_processor=CLIPImageProcessor(crop_size=32, size=32), shap_e_renderer=renderer, scheduler=scheduler,
    )


def _run_shap_e_img2img(pipe: Any) -> Any:
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return pipe(image=image, num_inference_steps=1, frame_size=32, generator=torch.Generator().manual_seed(0),
                output_type="latent")[0]


def _t5(tokenizer: Any, d_model: int) -> Any:
    from .tiny_pipelines import _t5_encoder

    return _seeded(lambda: _t5_encoder(len(tokenizer), d_model).eval())


def _build_pixart_sigma():
    from diffusers import DDIMScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel

    tokenizer = t5_tokenizer()
    transformer = _seeded(lambda: PixArtTransformer2DModel(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=3,
        caption_channels=32, in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True,
        activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
        norm_elementwise_affine=False, norm_eps=1e-6,
    ))
    return PixArtSigmaPipeline(tokenizer=tokenizer, text_encoder=_t5(tokenizer, 32), vae=_sd_vae(),
                               transformer=transformer, scheduler=DDIMScheduler())


def _run_pixart_sigma(pipe: Any) -> Any:
    return pipe(prompt="a squirrel", negative_prompt="blurry", num_inference_steps=2, guidance_scale=5.0,
                height=32, width=32, max_sequence_length=16, use_resolution_binning=False,
                generator=torch.Generator().manual_seed(0), output_type="np").images


def _build_chroma():
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    from .tiny_pipelines import _autoencoder_kl

    tokenizer = t5_tokenizer()
    transformer = _seeded(lambda: ChromaTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_hidden_dim=32,
        approximator_layers=1, approximator_num_channels=16,
    ))
    return ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_seeded(lambda: _autoencoder_kl(0.3611, 0.1159)),
                          text_encoder=_t5(tokenizer, 32), tokenizer=tokenizer, transformer=transformer)


def _run_chroma(pipe: Any) -> Any:
    return pipe(prompt="a squirrel", negative_prompt="blurry", num_inference_steps=2, guidance_scale=5.0,
                height=32, width=32, max_sequence_length=16,
                generator=torch.Generator().manual_seed(0), output_type="np").images


#: family name -> (builder, runner)
FAMILIES: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "sd-controlnet": (_build_sd_controlnet, _run_sd_controlnet),
    "sd-image-variation": (_build_sd_image_variation, _run_sd_image_variation),
    "kandinsky2.2": (_build_kandinsky22, _run_kandinsky22),
    "dit": (_build_dit, _run_dit),
    "shap-e-img2img": (_build_shap_e_img2img, _run_shap_e_img2img),
    "pixart-sigma": (_build_pixart_sigma, _run_pixart_sigma),
    "chroma": (_build_chroma, _run_chroma),
}


def _registry() -> dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]:
    return {**FAMILIES, **tiny_image_families.FAMILIES, **tiny_video_families.FAMILIES}


def _family(name: str) -> tuple[Callable[[], Any], Callable[[Any], Any]]:
    families = _registry()
    if name not in families:
        raise ValueError(f"family={name!r} is not a tiny family; allowed: {sorted(families)}")
    return families[name]


def build(name: str) -> Any:
    """A new tiny random pipeline of family ``name`` (this module's ``FAMILIES``, or those of
    ``tiny_image_families`` and ``tiny_video_families``) on the host (progress bar off).

    Raises:
        ValueError: ``name`` is not a tiny family (the message lists them).
    """
    pipe = _family(name)[0]()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run(name: str, pipe: Any) -> torch.Tensor:
    """Call ``pipe`` (a family ``name`` pipeline) with fixed seeds and two steps; returns
    its output as a float64 host tensor: images ``(1, H, W, 3)`` in [0, 1] (H = W = 32 but
    Lumina2 16, Qwen-Image-Edit 64, Stable Cascade 128), video frames ``(1, F, H, W, 3)``
    (LTX-2: the frames and the audio waveform, flattened and concatenated), Shap-E latents.

    Raises:
        ValueError: ``name`` is not a tiny family (the message lists them).
    """
    out = _family(name)[1](pipe)
    return torch.as_tensor(out).detach().to("cpu", torch.float64)
