"""Tiny random pipelines of diffusers' video families, for the compatibility matrix.

``FAMILIES`` maps a name to its builder (a pipeline on the host, random weights seeded per
component, our own tokenizers from ``tiny_tokenizers``, built offline) and runner (the
pipeline's ``output_type="np"`` frames, shape ``(1, F, H, W, 3)`` (LTX-2: see below), two
denoising steps, fixed seeds); build and run them by name with ``tiny_families.build``/``run``.

Families (``FAMILIES``), each as small as its diffusers 0.42 classes allow:

- ``"hunyuan-video"``: ``HunyuanVideoPipeline`` (Llama + CLIP text encoders; our Qwen2
  byte-level tokenizer stands in for Llama's, the prompt template is ``"{}"``).
- ``"hunyuan-video-1.5"``: ``HunyuanVideo15Pipeline`` (Qwen2.5-VL text model with a ChatML
  template, ByT5 glyph encoder: the prompt quotes a word so that it runs).
- ``"ltx-video"``: ``LTXPipeline`` (T5 text encoder, ``AutoencoderKLLTXVideo``).
- ``"ltx2"``: ``LTX2Pipeline`` (Gemma 3 text encoder, text connectors, video and audio VAEs,
  vocoder); ``run`` returns the frames and the audio waveform, flattened into one vector.
- ``"cogvideox"``: ``CogVideoXPipeline`` (T5, ``AutoencoderKLCogVideoX``).
- ``"mochi"``: ``MochiPipeline`` (T5, ``AutoencoderKLMochi``; the DiT runs under
  ``torch.autocast``).
- ``"skyreels-v2"``: ``SkyReelsV2Pipeline`` (T5, the Wan VAE; the pipeline needs ``ftfy``).
- ``"animatediff"``: ``AnimateDiffPipeline`` (an SD UNet with a ``MotionAdapter``, CLIP; the
  pipeline copies the adapter into a ``UNetMotionModel`` and never calls ``motion_adapter``).
- ``"kandinsky5"``: ``Kandinsky5T2VPipeline`` (Qwen2.5-VL + CLIP text encoders, the
  HunyuanVideo VAE).

Where a pipeline drops its prompt template's system prefix by a token count made for the
real tokenizer (HunyuanVideo 1.5, Kandinsky 5), the count is set to that prefix's length in
our tokenizer, so that the prompt's own tokens reach the DiT.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .tiny_tokenizers import clip_tokenizer, qwen2_tokenizer, t5_tokenizer

__all__ = ["FAMILIES", "build", "run"]


def _seeded(factory: Callable[[], Any]) -> Any:
    torch.manual_seed(0)
    return factory()


def _call(pipe: Any, **kwargs: Any) -> Any:
    """``pipe(**kwargs)`` with our defaults: prompt "a cat", negative prompt "blurry", two
    steps, the CPU generator seeded 0, ``output_type="np"``."""
    defaults = {"prompt": "a cat", "negative_prompt": "blurry", "num_inference_steps": 2,
                "generator": torch.Generator("cpu").manual_seed(0), "output_type": "np"}
    return pipe(**{**defaults, **kwargs})


def _t5(tokenizer: Any, d_model: int = 32) -> Any:
    from .tiny_pipelines import _t5_encoder

    return _seeded(lambda: _t5_encoder(len(tokenizer), d_model).eval())


def _clip_text(tokenizer: Any, hidden: int) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    return _seeded(lambda: CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=hidden, intermediate_size=37,
        num_attention_heads=4, num_hidden_layers=2, vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.model_max_length,
    )).eval())


# --------------------------------------------------------------------------- HunyuanVideo


def _llama(tokenizer: Any, hidden: int) -> Any:
    from transformers import LlamaConfig, LlamaModel

    pad = tokenizer.pad_token_id
    return _seeded(lambda: LlamaModel(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=pad, eos_token_id=pad,
        pad_token_id=pad,
    )).eval())


def _build_hunyuan_video():
    from diffusers import (
        AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline,
        HunyuanVideoTransformer3DModel,
    )

    transformer = _seeded(lambda: HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
    ))
    vae = _seeded(lambda: AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
        layers_per_block=1, norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
        temporal_compression_ratio=4, mid_block_add_attention=True,
    ))
    tokenizer, tokenizer_2 = qwen2_tokenizer(), clip_tokenizer()
    return HunyuanVideoPipeline(
        text_encoder=_llama(tokenizer, 16), tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=_clip_text(tokenizer_2, 8), tokenizer_2=tokenizer_2,
    )


def _run_hunyuan_video(pipe: Any) -> Any:
    return _call(pipe, negative_prompt=None, prompt_template={"template": "{}", "crop_start": 0},
                 guidance_scale=4.5, height=16, width=16, num_frames=5,
                 max_sequence_length=16).frames


# --------------------------------------------------------------------------- LTX-Video


def _build_ltx_video():
    from diffusers import (
        AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline,
        LTXVideoTransformer3DModel,
    )

    transformer = _seeded(lambda: LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=4,
        attention_head_dim=8, cross_attention_dim=32, num_layers=2, caption_channels=32,
    ))
    vae = _seeded(lambda: AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1), patch_size=1,
        patch_size_t=1, encoder_causal=True, decoder_causal=False,
    ))
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    tokenizer = t5_tokenizer()
    return LTXPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                       text_encoder=_t5(tokenizer), tokenizer=tokenizer, transformer=transformer)


def _run_ltx_video(pipe: Any) -> Any:
    return _call(pipe, guidance_scale=3.0, height=32, width=32, num_frames=9,
                 max_sequence_length=16).frames


# --------------------------------------------------------------------------- CogVideoX


def _build_cogvideox():
    from diffusers import (
        AutoencoderKLCogVideoX, CogVideoXPipeline, CogVideoXTransformer3DModel, DDIMScheduler,
    )

    transformer = _seeded(lambda: CogVideoXTransformer3DModel(
        num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
        time_embed_dim=2, text_embed_dim=32, num_layers=2, sample_width=2, sample_height=2,
        sample_frames=9, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=16,
    ))
    vae = _seeded(lambda: AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 4,
        up_block_types=("CogVideoXUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8),
        latent_channels=4, layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4,
    ))
    tokenizer = t5_tokenizer()
    return CogVideoXPipeline(tokenizer=tokenizer, text_encoder=_t5(tokenizer), vae=vae,
                             transformer=transformer, scheduler=DDIMScheduler())


def _run_cogvideox(pipe: Any) -> Any:
    return _call(pipe, guidance_scale=6.0, height=16, width=16, num_frames=8,
                 max_sequence_length=16).frames


# --------------------------------------------------------------------------- Mochi


def _build_mochi():
    from diffusers import (
        AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiPipeline, MochiTransformer3DModel,
    )

    def transformer_factory():
        model = MochiTransformer3DModel(
            patch_size=2, num_attention_heads=4, attention_head_dim=32, num_layers=3,
            pooled_projection_dim=16, in_channels=12, out_channels=None, qk_norm="rms_norm",
            text_embed_dim=32, time_embed_dim=4, activation_fn="swiglu", max_sequence_length=16,
        )
        # diffusers' own tests zero the RoPE frequencies too (random ones overflow)
        with torch.no_grad():
            model.pos_frequencies.zero_()
        return model

    # the VAE's group norms need 32 channels: the DiT is wider so that half of the weights
    # (the matrix's budget) holds the VAE that stays on the device
    vae = _seeded(lambda: AutoencoderKLMochi(
        latent_channels=12, out_channels=3, encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
    ))
    tokenizer = t5_tokenizer()
    return MochiPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                         text_encoder=_t5(tokenizer), tokenizer=tokenizer,
                         transformer=_seeded(transformer_factory))


def _run_mochi(pipe: Any) -> Any:
    return _call(pipe, guidance_scale=4.5, height=16, width=16, num_frames=7,
                 max_sequence_length=16).frames


# --------------------------------------------------------------------------- SkyReels-V2


def _build_skyreels_v2():
    from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

    from .tiny_pipelines import _wan_vae

    transformer = _seeded(lambda: SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ))
    tokenizer = t5_tokenizer()
    scheduler = UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True)
    return SkyReelsV2Pipeline(tokenizer=tokenizer, text_encoder=_t5(tokenizer),
                              transformer=transformer, vae=_seeded(_wan_vae), scheduler=scheduler)


def _run_skyreels_v2(pipe: Any) -> Any:
    return _call(pipe, guidance_scale=6.0, height=16, width=16, num_frames=9,
                 max_sequence_length=16).frames


# --------------------------------------------------------------------------- AnimateDiff


def _build_animatediff():
    from diffusers import (
        AnimateDiffPipeline, AutoencoderKL, DDIMScheduler, MotionAdapter, UNet2DConditionModel,
    )

    unet = _seeded(lambda: UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=16, in_channels=4,
        out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
        norm_num_groups=2,
    ))
    vae = _seeded(lambda: AutoencoderKL(
        block_out_channels=[8, 16], in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4, norm_num_groups=2,
    ))
    motion_adapter = _seeded(lambda: MotionAdapter(
        block_out_channels=(8, 16), motion_layers_per_block=1, motion_norm_num_groups=2,
        motion_num_attention_heads=2,
    ))
    tokenizer = clip_tokenizer()
    scheduler = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="linear",
                              clip_sample=False)
    return AnimateDiffPipeline(vae=vae, text_encoder=_clip_text(tokenizer, 32), tokenizer=tokenizer,
                               unet=unet, motion_adapter=motion_adapter, scheduler=scheduler,
                               feature_extractor=None, image_encoder=None)


def _run_animatediff(pipe: Any) -> Any:
    return _call(pipe, num_frames=2, height=16, width=16, guidance_scale=7.5).frames


# --------------------------------------------------------------------------- HunyuanVideo 1.5

#: a ChatML template for the tiny Qwen2 tokenizer (HunyuanVideo 1.5 calls ``apply_chat_template``)
_CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _qwen2_5_vl_text(tokenizer: Any, hidden: int) -> Any:
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    pad = tokenizer.pad_token_id
    return _seeded(lambda: Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, bos_token_id=pad, eos_token_id=pad,
        pad_token_id=pad,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                         "mrope_section": [1, 1, 2]},
    )).eval())


def _build_hunyuan_video15():
    from diffusers import (
        AutoencoderKLHunyuanVideo15, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    transformer = _seeded(lambda: HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
        text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16,
        task_type="t2v",
    ).eval())
    vae = _seeded(lambda: AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 16),
        layers_per_block=1, spatial_compression_ratio=4, temporal_compression_ratio=2,
        downsample_match_channel=False, upsample_match_channel=False,
    ).eval())
    tokenizer = qwen2_tokenizer()
    tokenizer.chat_template = _CHATML
    tokenizer_2 = ByT5Tokenizer()  # byte-level: no vocabulary file
    text_encoder_2 = _seeded(lambda: T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
    )).eval())
    pipe = HunyuanVideo15Pipeline(
        text_encoder=_qwen2_5_vl_text(tokenizer, 16), tokenizer=tokenizer, transformer=transformer,
        vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=4.0),
    )
    # 1000 and 256 text tokens otherwise
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length = 16, 16
    # the pipeline drops the chat template's system prefix by token count (108 with the real
    # tokenizer)
    system = [{"role": "system", "content": pipe.system_message}]
    prefix = tokenizer.apply_chat_template(system, tokenize=False) + "<|im_start|>user\n"
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix)["input_ids"])
    return pipe


def _run_hunyuan_video15(pipe: Any) -> Any:
    # the quoted word is the glyph text that text_encoder_2 (ByT5) encodes; without one it
    # does not run
    return _call(pipe, prompt='a cat with a sign that says "cat"', height=16, width=16,
                 num_frames=5).frames


# --------------------------------------------------------------------------- Kandinsky 5


def _build_kandinsky5():
    from diffusers import (
        AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline,
        Kandinsky5Transformer3DModel,
    )

    from .tiny_pipelines import _qwen2_5_vl_encoder

    vae = _seeded(lambda: AutoencoderKLHunyuanVideo(
        in_channels=3, out_channels=3, spatial_compression_ratio=8, temporal_compression_ratio=4,
        latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
    ).eval())
    def transformer_factory():
        model = Kandinsky5Transformer3DModel(
            in_visual_dim=4, in_text_dim=32, in_text_dim2=32, time_dim=32, out_visual_dim=4,
            patch_size=(1, 2, 2), model_dim=48, ff_dim=128, num_text_blocks=1, num_visual_blocks=2,
            axes_dims=(8, 8, 8), visual_cond=False,
        ).eval()
        # its modulations start at zero (every block's gates closed: the output would not
        # depend on the blocks or the text); random ones make every block count
        with torch.no_grad():
            for module in model.modules():
                if type(module).__name__ == "Kandinsky5Modulation":
                    torch.nn.init.normal_(module.out_layer.weight, std=0.1)
                    torch.nn.init.normal_(module.out_layer.bias, std=0.1)
        return model

    transformer = _seeded(transformer_factory)
    tokenizer, tokenizer_2 = qwen2_tokenizer(), clip_tokenizer()
    pipe = Kandinsky5T2VPipeline(
        transformer=transformer, vae=vae,
        text_encoder=_seeded(lambda: _qwen2_5_vl_encoder(tokenizer).eval()), tokenizer=tokenizer,
        text_encoder_2=_clip_text(tokenizer_2, 32), tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )
    # the pipeline drops the template's system prefix by token count (128 with the real tokenizer)
    prefix = pipe.prompt_template.split("{}")[0]
    pipe.prompt_template_encode_start_idx = len(tokenizer(prefix)["input_ids"])
    return pipe


def _run_kandinsky5(pipe: Any) -> Any:
    return _call(pipe, guidance_scale=5.0, height=32, width=32, num_frames=5,
                 max_sequence_length=16).frames


# --------------------------------------------------------------------------- LTX-2


def _gemma3(tokenizer: Any, hidden: int, layers: int) -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    pad = tokenizer.pad_token_id
    config = Gemma3Config(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 32,
            "num_hidden_layers": layers,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "max_position_embeddings": 256,
            "sliding_window": 16, "bos_token_id": pad, "eos_token_id": pad, "pad_token_id": pad,
        },
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 16, "patch_size": 4},
        mm_tokens_per_image=4,
    )
    return _seeded(lambda: Gemma3ForConditionalGeneration(config).eval())


def _build_ltx2():
    from diffusers import (
        AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline, LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    tokenizer = qwen2_tokenizer()
    text_hidden, text_layers = 32, 2  # the connectors (4 heads x 8) take the caption width as is
    transformer = _seeded(lambda: LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,
        num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=text_hidden,
        rope_double_precision=False, rope_type="split",
    ))
    connectors = _seeded(lambda: LTX2TextConnectors(
        caption_channels=text_hidden, text_proj_in_factor=text_layers + 1,
        video_connector_num_attention_heads=4, video_connector_attention_head_dim=8,
        video_connector_num_layers=1, video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=4, audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1, audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32, rope_theta=10000.0, rope_double_precision=False,
        causal_temporal_positioning=False, rope_type="split",
    ))

    def vae_factory():
        vae = AutoencoderKLLTX2Video(
            in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,),
            decoder_block_out_channels=(8,), layers_per_block=(1,), decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False), downsample_type=("spatial",),
            upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=False,
            patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
        )
        vae.use_framewise_encoding = False
        vae.use_framewise_decoding = False
        return vae

    audio_vae = _seeded(lambda: AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None,
        in_channels=2, resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height",
        dropout=0.0, mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160,
        is_causal=True, mel_bins=8,
    ))
    vocoder = _seeded(lambda: LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1, output_sampling_rate=16000,
    ))
    return LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=_seeded(vae_factory), audio_vae=audio_vae,
        text_encoder=_gemma3(tokenizer, text_hidden, text_layers), tokenizer=tokenizer,
        connectors=connectors, transformer=transformer, vocoder=vocoder, processor=None,
        prompt_enhancer=None, duration_head=None,
    )


def _run_ltx2(pipe: Any) -> Any:
    # classifier-free guidance on, the other guidance terms off (diffusers' own fast test pins
    # them likewise)
    out = _call(pipe, guidance_scale=3.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0,
                audio_guidance_scale=3.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
                audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None,
                use_cross_timestep=False, height=32, width=32, num_frames=5, frame_rate=25.0,
                max_sequence_length=16)
    # the frames, then the audio waveform (audio_vae and vocoder decode it)
    # the pipeline leaves the audio on its device
    audio = torch.as_tensor(out.audio).detach().to("cpu", torch.float32)
    return torch.cat([torch.as_tensor(out.frames).flatten(), audio.flatten()])


#: family name -> (builder, runner)
FAMILIES: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "hunyuan-video": (_build_hunyuan_video, _run_hunyuan_video),
    "hunyuan-video-1.5": (_build_hunyuan_video15, _run_hunyuan_video15),
    "ltx-video": (_build_ltx_video, _run_ltx_video),
    "ltx2": (_build_ltx2, _run_ltx2),
    "cogvideox": (_build_cogvideox, _run_cogvideox),
    "mochi": (_build_mochi, _run_mochi),
    "skyreels-v2": (_build_skyreels_v2, _run_skyreels_v2),
    "animatediff": (_build_animatediff, _run_animatediff),
    "kandinsky5": (_build_kandinsky5, _run_kandinsky5),
}
