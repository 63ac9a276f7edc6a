"""The published architectures behind the shipped weightless configs.

Each entry is the pipeline's ``model_index.json`` plus every component's constructor
arguments, copied from the model's published diffusers/transformers configs (the
``config.json`` files of the hub repositories named below; for Wan, the architecture
table of the Wan 2.1/2.2 reports: 14B: dim 5120, 40 heads, 40 layers, FFN 13824; 1.3B:
dim 1536, 12 heads, 30 layers, FFN 8960; UMT5-XXL text encoder; Wan-VAE base 96). The
JSON files under ``planner/configs/`` are written from here by :func:`write_configs`
(``python -m diffusion_offload.planner.published``) and hold no weights; the planner
builds the components on the meta device to count their parameters.

Published sizes the shipped configs reproduce (``tests/test_planner_configs.py``, within
2 %): Wan2.2-T2V-A14B: each DiT expert 14.3e9 parameters (28.6 GB in bf16), UMT5-XXL
encoder 5.7e9; FLUX.1-dev DiT 11.9e9; SD3.5-large DiT 8.1e9; Qwen-Image DiT 20.4e9;
Wan2.1-T2V-1.3B DiT between 1.3e9 and 1.5e9.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MODELS", "write_configs"]

# Wan-VAE latent statistics (Wan 2.1 ``vae.py``; also the Qwen-Image VAE's)
_WAN_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
_WAN_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]

_UMT5_XXL = {  # google/umt5-xxl, the Wan text encoder (encoder only)
    "model_type": "umt5", "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64,
    "num_layers": 24, "num_decoder_layers": 24, "vocab_size": 256384,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6,
    "tie_word_embeddings": False, "is_encoder_decoder": True, "scalable_attention": True,
    "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
    "architectures": ["UMT5EncoderModel"],
}

_T5_V1_1_XXL = {  # google/t5-v1_1-xxl encoder, FLUX.1 text_encoder_2 and SD3.5 text_encoder_3
    "model_type": "t5", "d_model": 4096, "d_ff": 10240, "d_kv": 64, "num_heads": 64,
    "num_layers": 24, "num_decoder_layers": 24, "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128, "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6,
    "tie_word_embeddings": False, "is_encoder_decoder": True, "pad_token_id": 0,
    "eos_token_id": 1, "decoder_start_token_id": 0, "architectures": ["T5EncoderModel"],
}

_CLIP_L = {  # openai/clip-vit-large-patch14 text tower
    "model_type": "clip_text_model", "vocab_size": 49408, "hidden_size": 768,
    "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "max_position_embeddings": 77, "hidden_act": "quick_gelu", "projection_dim": 768,
    "layer_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}

_CLIP_BIGG = {  # laion CLIP-ViT-bigG-14 text tower (SD3.5 text_encoder_2)
    "model_type": "clip_text_model", "vocab_size": 49408, "hidden_size": 1280,
    "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 20,
    "max_position_embeddings": 77, "hidden_act": "gelu", "projection_dim": 1280,
    "layer_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 1,
}

_WAN_VAE = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0,
    "latents_mean": _WAN_LATENTS_MEAN, "latents_std": _WAN_LATENTS_STD,
}

_WAN_14B = {  # Wan2.2-T2V-A14B: each expert (transformer, transformer_2)
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128,
    "in_channels": 16, "out_channels": 16, "text_dim": 4096, "freq_dim": 256,
    "ffn_dim": 13824, "num_layers": 40, "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}

_UNIPC_FLOW = {
    "prediction_type": "flow_prediction", "use_flow_sigmas": True, "num_train_timesteps": 1000,
    "solver_order": 2, "predict_x0": True, "solver_type": "bh2", "lower_order_final": True,
    "final_sigmas_type": "zero", "timestep_spacing": "linspace",
}

_AUTOENCODER_KL_16 = {  # FLUX.1 / SD3.5 VAE: 16 latent channels, 8x spatial
    "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "act_fn": "silu",
    "norm_num_groups": 32, "sample_size": 1024, "use_quant_conv": False,
    "use_post_quant_conv": False, "force_upcast": True,
}

MODELS: dict[str, dict[str, Any]] = {
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": {
        "pipeline": ["diffusers", "WanPipeline"],
        "extra": {"boundary_ratio": 0.875, "expand_timesteps": False},
        "dtype": "bfloat16",
        "source": "Wan-AI/Wan2.2-T2V-A14B-Diffusers (two 14B experts, UMT5-XXL, Wan-VAE 2.1)",
        "components": {
            "scheduler": ("diffusers", "UniPCMultistepScheduler", {**_UNIPC_FLOW, "flow_shift": 12.0}),
            "text_encoder": ("transformers", "UMT5EncoderModel", _UMT5_XXL),
            "tokenizer": ("transformers", "T5TokenizerFast", None),
            "transformer": ("diffusers", "WanTransformer3DModel", _WAN_14B),
            "transformer_2": ("diffusers", "WanTransformer3DModel", _WAN_14B),
            "vae": ("diffusers", "AutoencoderKLWan", _WAN_VAE),
        },
    },
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": {
        "pipeline": ["diffusers", "WanPipeline"],
        "extra": {},
        "dtype": "bfloat16",
        "source": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers (1.3B DiT, UMT5-XXL, Wan-VAE 2.1)",
        "components": {
            "scheduler": ("diffusers", "UniPCMultistepScheduler", {**_UNIPC_FLOW, "flow_shift": 3.0}),
            "text_encoder": ("transformers", "UMT5EncoderModel", _UMT5_XXL),
            "tokenizer": ("transformers", "T5TokenizerFast", None),
            "transformer": ("diffusers", "WanTransformer3DModel", {
                **_WAN_14B, "num_attention_heads": 12, "ffn_dim": 8960, "num_layers": 30}),
            "vae": ("diffusers", "AutoencoderKLWan", _WAN_VAE),
        },
    },
    "black-forest-labs/FLUX.1-dev": {
        "pipeline": ["diffusers", "FluxPipeline"],
        "extra": {},
        "dtype": "bfloat16",
        "source": "black-forest-labs/FLUX.1-dev (12B-class MMDiT, CLIP-L, T5-v1.1-XXL)",
        "components": {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", {
                "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
                "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
                "max_image_seq_len": 4096}),
            "text_encoder": ("transformers", "CLIPTextModel", _CLIP_L),
            "text_encoder_2": ("transformers", "T5EncoderModel", _T5_V1_1_XXL),
            "tokenizer": ("transformers", "CLIPTokenizer", None),
            "tokenizer_2": ("transformers", "T5TokenizerFast", None),
            "transformer": ("diffusers", "FluxTransformer2DModel", {
                "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                "pooled_projection_dim": 768, "guidance_embeds": True,
                "axes_dims_rope": [16, 56, 56]}),
            "vae": ("diffusers", "AutoencoderKL", {
                **_AUTOENCODER_KL_16, "scaling_factor": 0.3611, "shift_factor": 0.1159}),
        },
    },
    "stabilityai/stable-diffusion-3.5-large": {
        "pipeline": ["diffusers", "StableDiffusion3Pipeline"],
        "extra": {},
        "dtype": "bfloat16",
        "source": "stabilityai/stable-diffusion-3.5-large (8B MMDiT, CLIP-L, CLIP-bigG, T5-v1.1-XXL)",
        "components": {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", {
                "num_train_timesteps": 1000, "shift": 3.0}),
            "text_encoder": ("transformers", "CLIPTextModelWithProjection", _CLIP_L),
            "text_encoder_2": ("transformers", "CLIPTextModelWithProjection", _CLIP_BIGG),
            "text_encoder_3": ("transformers", "T5EncoderModel", _T5_V1_1_XXL),
            "tokenizer": ("transformers", "CLIPTokenizer", None),
            "tokenizer_2": ("transformers", "CLIPTokenizer", None),
            "tokenizer_3": ("transformers", "T5TokenizerFast", None),
            "transformer": ("diffusers", "SD3Transformer2DModel", {
                "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38,
                "attention_head_dim": 64, "num_attention_heads": 38, "joint_attention_dim": 4096,
                "caption_projection_dim": 2432, "pooled_projection_dim": 2048, "out_channels": 16,
                "pos_embed_max_size": 192, "qk_norm": "rms_norm", "dual_attention_layers": []}),
            "vae": ("diffusers", "AutoencoderKL", {
                **_AUTOENCODER_KL_16, "scaling_factor": 1.5305, "shift_factor": 0.0609}),
        },
    },
    "Qwen/Qwen-Image": {
        "pipeline": ["diffusers", "QwenImagePipeline"],
        "extra": {},
        "dtype": "bfloat16",
        "source": "Qwen/Qwen-Image (20B MMDiT, Qwen2.5-VL-7B text encoder, Qwen-Image VAE)",
        "components": {
            "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler", {
                "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
                "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
                "max_image_seq_len": 8192, "shift_terminal": 0.02,
                "time_shift_type": "exponential"}),
            "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration", {
                "model_type": "qwen2_5_vl",
                "text_config": {
                    "model_type": "qwen2_5_vl_text", "vocab_size": 152064, "hidden_size": 3584,
                    "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
                    "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                        "mrope_section": [16, 24, 24]},
                    "tie_word_embeddings": False, "bos_token_id": 151643,
                    "eos_token_id": 151645,
                },
                "vision_config": {
                    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                    "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2,
                    "temporal_patch_size": 2, "window_size": 112,
                    "fullatt_block_indexes": [7, 15, 23, 31], "in_chans": 3,
                    "hidden_act": "silu", "tokens_per_second": 2,
                },
                "image_token_id": 151655, "video_token_id": 151656,
                "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                "tie_word_embeddings": False,
            }),
            "tokenizer": ("transformers", "Qwen2Tokenizer", None),
            "transformer": ("diffusers", "QwenImageTransformer2DModel", {
                "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                "guidance_embeds": False, "axes_dims_rope": [16, 56, 56]}),
            "vae": ("diffusers", "AutoencoderKLQwenImage", _WAN_VAE),
        },
    },
}
"""hub id -> pipeline class, load dtype, source, and per component (library, class, args)."""


def _component_config(library: str, class_name: str, args: dict[str, Any]) -> dict[str, Any]:
    """The full ``config.json`` the library writes for ``class_name(**args)``."""
    import importlib

    cls = getattr(importlib.import_module(library), class_name)
    if library == "diffusers":
        if class_name.endswith("Scheduler"):
            return dict(cls.from_config(args).config)
        import torch

        with torch.device("meta"):
            module = cls.from_config(args)
        return dict(module.config)
    config = cls.config_class(**{k: v for k, v in args.items() if k != "model_type"})
    return config.to_dict()


def write_configs(root: Path) -> list[Path]:
    """Write every model of :data:`MODELS` under ``root/<org>/<name>/`` and return the
    folders written (``model_index.json`` and one ``config.json`` or
    ``scheduler_config.json`` per component; no weights, no tokenizer files)."""
    import diffusers

    written = []
    for hub_id, spec in MODELS.items():
        folder = root / hub_id
        folder.mkdir(parents=True, exist_ok=True)
        index: dict[str, Any] = {
            "_class_name": spec["pipeline"][1],
            "_diffusers_version": diffusers.__version__,
            "_diffusion_offload_weightless": {"dtype": spec["dtype"], "source": spec["source"]},
            **spec["extra"],
        }
        for name, (library, class_name, args) in sorted(spec["components"].items()):
            index[name] = [library, class_name]
            if args is None:
                continue
            config = _component_config(library, class_name, args)
            config.pop("_name_or_path", None)
            config.pop("transformers_version", None)
            config.pop("_diffusers_version", None)
            config.pop("_use_default_values", None)
            sub = folder / name
            sub.mkdir(exist_ok=True)
            file = "scheduler_config.json" if class_name.endswith("Scheduler") else "config.json"
            (sub / file).write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
        (folder / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append(folder)
    return written


if __name__ == "__main__":  # pragma: no cover - maintenance entry point
    from .model import configs_root

    for path in write_configs(configs_root()):
        print(path)
