"""Tiny random pipelines of diffusers *image* families for the compatibility matrix (issue 25).

``FAMILIES`` maps a name to its builder (a pipeline on the host, random weights seeded per
component, our own tokenizers from ``tiny_tokenizers``) and runner (the pipeline's
``output_type="np"`` images ``(1, H, W, 3)``, H = W = 32 unless stated, two denoising steps,
guidance on); build and run them by name with ``tiny_families.build``/``run``.
The text encoders that transformers ships in large sizes only (Gemma 2, Llama, Qwen3,
Mistral 3) are built from tiny configs.

Families (``FAMILIES``):

- ``"flux-controlnet"``: ``FluxControlNetPipeline`` (FLUX.1 transformer + ``FluxControlNetModel``).
- ``"sdxl-controlnet"``: ``StableDiffusionXLControlNetPipeline`` (SDXL unet + ``ControlNetModel``,
  two CLIP text encoders).
- ``"z-image"``: ``ZImagePipeline`` (``ZImageTransformer2DModel``, Qwen3 text encoder).
- ``"sana"``: ``SanaPipeline`` (``SanaTransformer2DModel``, Gemma 2, ``AutoencoderDC``).
- ``"lumina2"``: ``Lumina2Pipeline`` (``Lumina2Transformer2DModel``, Gemma 2); images
  ``(1, 16, 16, 3)``.
- ``"hidream"``: ``HiDreamImagePipeline`` (``HiDreamImageTransformer2DModel``, two CLIPs, T5, Llama).
- ``"flux2"``: ``Flux2Pipeline`` (``Flux2Transformer2DModel``, Mistral 3, ``AutoencoderKLFlux2``).
- ``"flux2-klein"``: ``Flux2KleinPipeline`` (``Flux2Transformer2DModel``, a ``Qwen3ForCausalLM`` text
  encoder whose hidden states of layers 1 and 2 make the prompt embedding, ``AutoencoderKLFlux2``;
  guidance by a negative prompt).
- ``"stable-cascade"``: ``StableCascadeCombinedPipeline`` (``prior_prior`` and ``decoder``
  ``StableCascadeUNet`` s, the prior's CLIP text encoder, ``vqgan``); images ``(1, 128, 128, 3)``.
- ``"qwen-image-edit"``: ``QwenImageEditPipeline`` (``tiny_pipelines``' Qwen-Image transformer and
  Qwen2.5-VL text encoder, which also sees the input image, and ``Qwen2VLProcessor``); images
  ``(1, 64, 64, 3)``.
- ``"kandinsky2.1-combined"``, ``"kandinsky2.1-img2img-combined"``, ``"kandinsky2.1-inpaint-combined"``,
  ``"kandinsky2.2-combined"``, ``"kandinsky2.2-img2img-combined"``, ``"kandinsky2.2-inpaint-combined"``:
  diffusers' Kandinsky ``...CombinedPipeline`` s, which nest a prior pipeline (``prior_prior``
  ``PriorTransformer``, its CLIP text and image encoders) and a decoder pipeline (``unet``,
  ``movq``; 2.1: the ``MultilingualCLIP`` text encoder) that share the combined pipeline's
  components; called without a negative prompt, so the prior's image encoder runs too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .tiny_tokenizers import clip_tokenizer, qwen2_tokenizer, t5_tokenizer

__all__ = ["FAMILIES", "build", "run"]

#: a chat template for our byte-level tokenizers (Z-Image, FLUX.2): a message's content is
#: a string or a list of ``{"type": "text", "text": ...}`` parts
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _seeded(factory: Callable[[], Any]) -> Any:
    torch.manual_seed(0)
    return factory()


def _sd_vae():
    """The 2-level SD-style ``AutoencoderKL`` (4 latent channels) several families share."""
    from diffusers import AutoencoderKL

    return _seeded(lambda: AutoencoderKL(
        block_out_channels=[4, 8], in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, latent_channels=4, norm_num_groups=2,
    ))


def _generator() -> torch.Generator:
    return torch.Generator("cpu").manual_seed(0)


def _control_image() -> torch.Tensor:
    return torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _chat_tokenizer() -> Any:
    tokenizer = qwen2_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def _flux_vae() -> Any:
    from .tiny_pipelines import _autoencoder_kl

    return _seeded(lambda: _autoencoder_kl(0.3611, 0.1159))


def _clip_text(tokenizer: Any, projection: bool, hidden: int = 32) -> Any:
    import transformers

    from .tiny_pipelines import _clip_config

    cls = transformers.CLIPTextModelWithProjection if projection else transformers.CLIPTextModel
    return _seeded(lambda: cls(_clip_config(len(tokenizer), hidden, hidden)).eval())


def _t5(tokenizer: Any, d_model: int = 32) -> Any:
    from .tiny_pipelines import _t5_encoder

    return _seeded(lambda: _t5_encoder(len(tokenizer), d_model).eval())


def _gemma2(tokenizer: Any, hidden: int) -> Any:
    from transformers import Gemma2Config, Gemma2Model

    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        attn_implementation="eager",
    )
    return _seeded(lambda: Gemma2Model(config).eval())


# --------------------------------------------------------------------------- FLUX.1 ControlNet


def _build_flux_controlnet():
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    from . import tiny_pipelines

    flux = tiny_pipelines.build("flux")
    controlnet = _seeded(lambda: FluxControlNetModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=[4, 6, 6],
    ))
    return FluxControlNetPipeline(controlnet=controlnet, **flux.components)


def _run_flux_controlnet(pipe: Any) -> Any:
    return pipe(prompt="a cat", control_image=_control_image(), controlnet_conditioning_scale=0.5,
                height=32, width=32, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=16,
                generator=_generator(), output_type="np").images


# --------------------------------------------------------------------------- SDXL + ControlNet


def _build_sdxl_controlnet():
    from diffusers import (
        ControlNetModel,
        EulerDiscreteScheduler,
        StableDiffusionXLControlNetPipeline,
        UNet2DConditionModel,
    )

    common = dict(
        block_out_channels=(8, 16), layers_per_block=1, in_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), attention_head_dim=(2, 4),
        use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 1), projection_class_embeddings_input_dim=80,  # 6 * 8 + 32
        cross_attention_dim=64, norm_num_groups=4,
    )
    unet = _seeded(lambda: UNet2DConditionModel(
        sample_size=16, out_channels=4, up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), **common))
    controlnet = _seeded(lambda: ControlNetModel(conditioning_embedding_out_channels=(16, 32), **common))
    tokenizer, tokenizer_2 = clip_tokenizer(), clip_tokenizer()
    scheduler = EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, steps_offset=1,
                                       beta_schedule="scaled_linear", timestep_spacing="leading")
    return StableDiffusionXLControlNetPipeline(
        vae=_sd_vae(), text_encoder=_clip_text(tokenizer, False), tokenizer=tokenizer,
        text_encoder_2=_clip_text(tokenizer_2, True), tokenizer_2=tokenizer_2, unet=unet,
        controlnet=controlnet, scheduler=scheduler, force_zeros_for_empty_prompt=True,
    )


def _run_sdxl_controlnet(pipe: Any) -> Any:
    return pipe(prompt="a cat", negative_prompt="blurry", image=_control_image(), height=32, width=32,
                num_inference_steps=2, guidance_scale=6.0, generator=_generator(), output_type="np").images


# --------------------------------------------------------------------------- Z-Image


def _build_z_image():
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tokenizer = _chat_tokenizer()

    def transformer() -> Any:
        model = ZImageTransformer2DModel(
            all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2,
            n_refiner_layers=1, n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=16,
            axes_dims=[8, 4, 4], axes_lens=[256, 32, 32],
        )
        with torch.no_grad():  # both are torch.empty in __init__
            model.x_pad_token.fill_(1.0)
            model.cap_pad_token.fill_(1.0)
        return model

    text_encoder = _seeded(lambda: Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )).eval())
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=_flux_vae(), text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=_seeded(transformer))


def _run_z_image(pipe: Any) -> Any:
    return pipe(prompt="a cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=2,
                guidance_scale=3.0, max_sequence_length=32, generator=_generator(), output_type="np").images


# --------------------------------------------------------------------------- Sana


def _build_sana():
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel

    tokenizer = t5_tokenizer()
    transformer = _seeded(lambda: SanaTransformer2DModel(
        patch_size=1, in_channels=4, out_channels=4, num_layers=2, num_attention_heads=2, attention_head_dim=4,
        num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=16,
        sample_size=32,
    ))
    vae = _seeded(lambda: AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), downsample_block_type="conv",
        upsample_block_type="interpolate", decoder_norm_types="rms_norm", decoder_act_fns="silu",
        scaling_factor=0.41407,
    ))
    return SanaPipeline(tokenizer=tokenizer, text_encoder=_gemma2(tokenizer, 16), vae=vae, transformer=transformer,
                        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))


def _run_sana(pipe: Any) -> Any:
    return pipe(prompt="a cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=2,
                guidance_scale=6.0, max_sequence_length=16, complex_human_instruction=None,
                use_resolution_binning=False, generator=_generator(), output_type="np").images


# --------------------------------------------------------------------------- Lumina2


def _build_lumina2():
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    tokenizer = t5_tokenizer()
    transformer = _seeded(lambda: Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(8, 4, 4), axes_lens=(300, 32, 32),
        cap_feat_dim=16,
    ).eval())
    return Lumina2Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=_flux_vae(),
                           text_encoder=_gemma2(tokenizer, 16), tokenizer=tokenizer)


def _run_lumina2(pipe: Any) -> Any:
    # Lumina2 assumes a VAE factor of 8: 64x64 is an 8x8 latent, decoded to 16x16 by this VAE
    return pipe(prompt="a cat", negative_prompt="blurry", height=64, width=64, num_inference_steps=2,
                guidance_scale=4.0, system_prompt="", max_sequence_length=32, generator=_generator(),
                output_type="np").images


# --------------------------------------------------------------------------- HiDream


def _build_hidream():
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline, HiDreamImageTransformer2DModel
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer, tokenizer_2 = clip_tokenizer(), clip_tokenizer()
    tokenizer_3, tokenizer_4 = t5_tokenizer(), t5_tokenizer()
    transformer = _seeded(lambda: HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=4, caption_channels=[32, 16], text_emb_dim=64, num_routed_experts=4,
        num_activated_experts=2, axes_dims_rope=(4, 2, 2), max_resolution=(32, 32), llama_layers=(0, 1),
    ).eval())
    llama = _seeded(lambda: LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer_4), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        pad_token_id=tokenizer_4.pad_token_id, eos_token_id=tokenizer_4.eos_token_id, bos_token_id=None,
    )).eval())
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_flux_vae(),
        text_encoder=_clip_text(tokenizer, True), tokenizer=tokenizer,
        text_encoder_2=_clip_text(tokenizer_2, True), tokenizer_2=tokenizer_2,
        text_encoder_3=_t5(tokenizer_3), tokenizer_3=tokenizer_3,
        text_encoder_4=llama, tokenizer_4=tokenizer_4, transformer=transformer,
    )
    pipe.default_sample_size = 16  # the pipeline rescales every request to this area (latent side)
    return pipe


def _run_hidream(pipe: Any) -> Any:
    return pipe(prompt="a cat", negative_prompt="blurry", height=32, width=32, num_inference_steps=2,
                guidance_scale=5.0, max_sequence_length=16, generator=_generator(), output_type="np").images


# --------------------------------------------------------------------------- FLUX.2


def _build_flux2():
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2Pipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = _chat_tokenizer()
    transformer = _seeded(lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=256, axes_dims_rope=(4, 4, 4, 4),
    ))
    pad = tokenizer.pad_token_id
    text_encoder = _seeded(lambda: Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={
            "model_type": "mistral", "vocab_size": len(tokenizer), "hidden_size": 16, "intermediate_size": 32,
            "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 2,
            "num_key_value_heads": 2, "head_dim": 4, "sliding_window": None, "pad_token_id": pad,
            "bos_token_id": pad, "eos_token_id": pad,
        },
        vision_config={
            "model_type": "pixtral", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4,
            "intermediate_size": 32, "image_size": 30, "patch_size": 6, "num_channels": 3,
        },
        image_token_index=tokenizer.convert_tokens_to_ids("<|image_pad|>"), vision_feature_layer=-1,
    )).eval())
    vae = _seeded(lambda: AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
    ))
    return Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                         tokenizer=tokenizer, transformer=transformer)


def _run_flux2(pipe: Any) -> Any:
    return pipe(prompt="a cat", height=32, width=32, num_inference_steps=2, guidance_scale=4.0,
                max_sequence_length=48, text_encoder_out_layers=(1,), generator=_generator(),
                output_type="np").images


# --------------------------------------------------------------------------- FLUX.2 [klein]


def _build_flux2_klein():
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _chat_tokenizer()
    # the prompt embedding stacks the hidden states of text_encoder_out_layers (1, 2): 2 x 16
    transformer = _seeded(lambda: Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=256, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    ))
    # a CausalLM wrapper: its blocks sit at model.layers, and its token table and LM head
    # (450 tokens) outweigh them, as a 150k-token Qwen3's do
    text_encoder = _seeded(lambda: Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )).eval())
    vae = _seeded(lambda: AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
    ))
    return Flux2KleinPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, transformer=transformer, is_distilled=False)


def _run_flux2_klein(pipe: Any) -> Any:
    return pipe(prompt="a cat", height=32, width=32, num_inference_steps=2, guidance_scale=4.0,
                max_sequence_length=32, text_encoder_out_layers=(1, 2), generator=_generator(),
                output_type="np").images


# --------------------------------------------------------------------------- Stable Cascade


def _build_stable_cascade():
    from diffusers import DDPMWuerstchenScheduler, StableCascadeCombinedPipeline, StableCascadeUNet
    from diffusers.pipelines.deprecated.wuerstchen.modeling_paella_vq_model import PaellaVQModel

    prior_tokenizer = clip_tokenizer()
    prior = _seeded(lambda: StableCascadeUNet(
        conditioning_dim=64, block_out_channels=(64, 64), num_attention_heads=(2, 2),
        down_num_layers_per_block=(1, 1), up_num_layers_per_block=(1, 1), clip_image_in_channels=16,
        switch_level=(False,), clip_text_in_channels=32, clip_text_pooled_in_channels=32,
        dropout=(0.0, 0.0),
    ).eval())
    decoder = _seeded(lambda: StableCascadeUNet(
        in_channels=4, out_channels=4, conditioning_dim=32, block_out_channels=(8, 16, 32, 32),
        num_attention_heads=(-1, -1, 1, 2), down_num_layers_per_block=(1, 1, 1, 1),
        up_num_layers_per_block=(1, 1, 1, 1), down_blocks_repeat_mappers=(1, 1, 1, 1),
        up_blocks_repeat_mappers=(2, 2, 1, 1),
        block_types_per_layer=(
            ("SDCascadeResBlock", "SDCascadeTimestepBlock"),
            ("SDCascadeResBlock", "SDCascadeTimestepBlock"),
            ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
            ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
        ),
        switch_level=None, clip_text_pooled_in_channels=32, dropout=(0.0, 0.0, 0.0, 0.0),
    ).eval())
    vqgan = _seeded(lambda: PaellaVQModel(bottleneck_blocks=1, embed_dim=16, num_vq_embeddings=2).eval())
    return StableCascadeCombinedPipeline(
        # the combined call never runs the decoder's own text encoder (the prior hands the
        # decoder its prompt embeddings), so the family leaves it out
        tokenizer=None, text_encoder=None, decoder=decoder,
        scheduler=DDPMWuerstchenScheduler(), vqgan=vqgan, prior_prior=prior,
        prior_text_encoder=_clip_text(prior_tokenizer, True), prior_tokenizer=prior_tokenizer,
        prior_scheduler=DDPMWuerstchenScheduler(), prior_feature_extractor=None, prior_image_encoder=None,
    )


def _run_stable_cascade(pipe: Any) -> Any:
    # the prior runs at ceil(128 / 42.67) = 3 latent pixels, the decoder at 32, the VQGAN decodes 128
    return pipe(prompt="a cat", negative_prompt="blurry", height=128, width=128, prior_num_inference_steps=2,
                prior_guidance_scale=4.0, num_inference_steps=2, decoder_guidance_scale=4.0,
                generator=_generator(), output_type="np").images


# --------------------------------------------------------------------------- Kandinsky combined

#: the width of every embedding of the tiny Kandinsky families: the prior's image embedding,
#: its CLIP text and image encoders' projections, the decoder UNet's cross-attention
_KANDINSKY_DIM = 16


def _xlm_roberta_tokenizer() -> Any:
    """A character-level Unigram ``XLMRobertaTokenizer`` (Kandinsky 2.1's decoder tokenizer)
    with XLM-R's special ids (``<s>=0``, ``<pad>=1``, ``</s>=2``, ``<unk>=3``), whole-word
    pieces for ``tiny_tokenizers``' words and ``<mask>`` last; 77 tokens at most."""
    from transformers import XLMRobertaTokenizer

    from .tiny_tokenizers import _WORDS

    pieces: list[tuple[str, float]] = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    pieces += [(c, -8.0) for c in chars] + [("\u2581" + c, -7.0) for c in chars]
    pieces += [("\u2581" + w, -4.0) for w in _WORDS if len(w) > 1] + [("<mask>", 0.0)]
    return XLMRobertaTokenizer(vocab=pieces, model_max_length=77)


def _kandinsky_prior_parts() -> dict[str, Any]:
    """The ``prior_*`` components of a Kandinsky 2.1 / 2.2 combined pipeline: a one-layer
    ``PriorTransformer`` (``clip_std`` set to ones, so the image embeddings are not all
    zero), CLIP text and image encoders with projections, ``UnCLIPScheduler``."""
    from diffusers import PriorTransformer, UnCLIPScheduler
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    dim = _KANDINSKY_DIM
    tokenizer = clip_tokenizer()

    def prior() -> Any:
        model = PriorTransformer(num_attention_heads=2, attention_head_dim=8, embedding_dim=dim, num_layers=1)
        torch.nn.init.ones_(model.clip_std)
        return model.eval()

    image_encoder = _seeded(lambda: CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=dim, projection_dim=dim, intermediate_size=32, num_attention_heads=2, num_hidden_layers=2,
        image_size=32, patch_size=8, num_channels=3,
    )).eval())
    return {
        "prior_prior": _seeded(prior),
        "prior_image_encoder": image_encoder,
        "prior_text_encoder": _clip_text(tokenizer, True, hidden=dim),
        "prior_tokenizer": tokenizer,
        "prior_scheduler": UnCLIPScheduler(variance_type="fixed_small_log", prediction_type="sample",
                                           num_train_timesteps=1000, clip_sample=True, clip_sample_range=10.0),
        "prior_image_processor": CLIPImageProcessor(crop_size=32, size=32),
    }


def _kandinsky_decoder_parts(version: str, in_channels: int) -> dict[str, Any]:
    """The decoder components of a Kandinsky combined pipeline: a two-level UNet conditioned
    on the prior's image embedding (2.1: and on ``MultilingualCLIP``'s text embedding, with
    its XLM-R tokenizer), a spatial-norm ``VQModel`` (``movq``: 32 channels, as its
    ``SpatialNorm`` s have 32 groups) and ``DDIMScheduler``.
    ``in_channels``: 4 (text-to-image, img2img) or 9 (inpaint: latents, masked image, mask)."""
    from diffusers import DDIMScheduler, UNet2DConditionModel, VQModel

    dim = _KANDINSKY_DIM
    conditioning: dict[str, Any] = (
        {"addition_embed_type": "text_image", "encoder_hid_dim_type": "text_image_proj"} if version == "2.1"
        else {"addition_embed_type": "image", "encoder_hid_dim_type": "image_proj"}
    )
    unet = _seeded(lambda: UNet2DConditionModel(
        in_channels=in_channels, out_channels=8, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
        up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
        mid_block_type="UNetMidBlock2DSimpleCrossAttn", encoder_hid_dim=dim, cross_attention_dim=dim,
        attention_head_dim=4, resnet_time_scale_shift="scale_shift", class_embed_type=None, norm_num_groups=8,
        **conditioning,
    ))
    movq = _seeded(lambda: VQModel(
        block_out_channels=[32, 32], down_block_types=["DownEncoderBlock2D", "AttnDownEncoderBlock2D"],
        in_channels=3, latent_channels=4, layers_per_block=1, norm_num_groups=8, norm_type="spatial",
        num_vq_embeddings=12, out_channels=3, up_block_types=["AttnUpDecoderBlock2D", "UpDecoderBlock2D"],
        vq_embed_dim=4,
    ))
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", beta_start=0.00085,
                              beta_end=0.012, clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    parts: dict[str, Any] = {"unet": unet, "movq": movq, "scheduler": scheduler}
    if version == "2.1":
        from diffusers.pipelines.kandinsky.text_encoder import MCLIPConfig, MultilingualCLIP

        tokenizer = _xlm_roberta_tokenizer()
        config = MCLIPConfig(
            transformerDimSize=dim, imageDimSize=dim, vocab_size=len(tokenizer), hidden_size=dim,
            intermediate_size=32, num_attention_heads=2, num_hidden_layers=2, max_position_embeddings=80,
            pad_token_id=tokenizer.pad_token_id, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
        )
        parts["text_encoder"] = _seeded(lambda: MultilingualCLIP(config).eval())
        parts["tokenizer"] = tokenizer
    return parts


#: family name -> (diffusers class name, Kandinsky version, decoder UNet input channels)
_KANDINSKY_COMBINED: dict[str, tuple[str, str, int]] = {
    "kandinsky2.1-combined": ("KandinskyCombinedPipeline", "2.1", 4),
    "kandinsky2.1-img2img-combined": ("KandinskyImg2ImgCombinedPipeline", "2.1", 4),
    "kandinsky2.1-inpaint-combined": ("KandinskyInpaintCombinedPipeline", "2.1", 9),
    "kandinsky2.2-combined": ("KandinskyV22CombinedPipeline", "2.2", 4),
    "kandinsky2.2-img2img-combined": ("KandinskyV22Img2ImgCombinedPipeline", "2.2", 4),
    "kandinsky2.2-inpaint-combined": ("KandinskyV22InpaintCombinedPipeline", "2.2", 9),
}


def _kandinsky_combined(name: str) -> Callable[[], Any]:
    cls_name, version, in_channels = _KANDINSKY_COMBINED[name]

    def build() -> Any:
        import diffusers

        parts = {**_kandinsky_decoder_parts(version, in_channels), **_kandinsky_prior_parts()}
        return getattr(diffusers, cls_name)(**parts)

    return build


def _kandinsky_inputs(name: str) -> dict[str, Any]:
    """The input image (img2img, inpaint: 32 x 32 RGB noise) and mask (inpaint: the upper
    left quarter, as a ``(32, 32)`` float array) of a Kandinsky combined family."""
    import numpy as np
    from PIL import Image

    out: dict[str, Any] = {}
    if "img2img" in name or "inpaint" in name:
        pixels = (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(1)) * 255).to(torch.uint8)
        out["image"] = Image.fromarray(pixels.numpy())
    if "img2img" in name:
        out["strength"] = 0.5
    if "inpaint" in name:
        mask = np.zeros((32, 32), dtype=np.float32)
        mask[:16, :16] = 1.0
        out["mask_image"] = mask
    return out


def _run_kandinsky_combined(name: str) -> Callable[[Any], Any]:
    def run(pipe: Any) -> Any:
        # no negative prompt: the prior then encodes a zero image with its image encoder
        # for the negative image embedding, so every component runs
        steps = 4 if "img2img" in name else 2  # strength 0.5: two denoising steps
        return pipe(prompt="a cat", height=32, width=32, num_inference_steps=steps, guidance_scale=4.0,
                    prior_num_inference_steps=2, prior_guidance_scale=4.0, generator=_generator(),
                    output_type="np", **_kandinsky_inputs(name)).images

    return run


# --------------------------------------------------------------------------- Qwen-Image-Edit


def _image_only(processor_cls: type) -> type:
    """``processor_cls`` without its video processor: transformers checks one's class even
    when it is None, and its video processors need torchvision (not a dependency); the
    pipelines pass images only."""

    class ImageOnly(processor_cls):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImageOnly.__name__ = processor_cls.__name__
    return ImageOnly


def _build_qwen_image_edit():
    from diffusers import AutoencoderKLQwenImage, QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessorPil, Qwen2VLProcessor

    from . import tiny_pipelines

    qwen = tiny_pipelines.build("qwen-image").components
    # the pipeline resizes the input image to about 1024 x 1024; the vision tower sees it
    # at 56 x 56 (4 x 4 patches of 14, merged 2 x 2: 4 image tokens)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    processor = _image_only(Qwen2VLProcessor)(image_processor=image_processor, tokenizer=qwen["tokenizer"])
    # the VAE encodes that 1024 x 1024 image: 2 channels at full resolution and a spatial
    # factor of 32 (a 32 x 32 latent, 256 image tokens) keep it and the transformer fast
    vae = _seeded(lambda: AutoencoderKLQwenImage(
        base_dim=2, z_dim=16, dim_mult=[1, 1, 1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True, True, True]))
    return QwenImageEditPipeline(scheduler=qwen["scheduler"], vae=vae, text_encoder=qwen["text_encoder"],
                                 tokenizer=qwen["tokenizer"], processor=processor, transformer=qwen["transformer"])


def _run_qwen_image_edit(pipe: Any) -> Any:
    from PIL import Image

    pixels = (torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(1)) * 255).to(torch.uint8)
    return pipe(image=Image.fromarray(pixels.numpy()), prompt="a cat", negative_prompt="blurry", height=64,
                width=64, num_inference_steps=2, true_cfg_scale=4.0, max_sequence_length=16,
                generator=_generator(), output_type="np").images


#: family name -> (builder, runner)
FAMILIES: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "flux-controlnet": (_build_flux_controlnet, _run_flux_controlnet),
    "sdxl-controlnet": (_build_sdxl_controlnet, _run_sdxl_controlnet),
    "z-image": (_build_z_image, _run_z_image),
    "sana": (_build_sana, _run_sana),
    "lumina2": (_build_lumina2, _run_lumina2),
    "hidream": (_build_hidream, _run_hidream),
    "flux2": (_build_flux2, _run_flux2),
    "flux2-klein": (_build_flux2_klein, _run_flux2_klein),
    "stable-cascade": (_build_stable_cascade, _run_stable_cascade),
    "qwen-image-edit": (_build_qwen_image_edit, _run_qwen_image_edit),
    **{name: (_kandinsky_combined(name), _run_kandinsky_combined(name)) for name in _KANDINSKY_COMBINED},
}
