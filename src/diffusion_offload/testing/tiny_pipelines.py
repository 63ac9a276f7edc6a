"""Tiny random-weight diffusers pipelines, built offline, in the real diffusers format.

Every kind in :data:`KINDS` is a genuine diffusers pipeline class whose components are the
real model classes (DiTs, VAEs, ``transformers`` text encoders, fast tokenizers, schedulers)
with tiny configurations, so that offload code sees the same module structure, component
names, entry points (``forward``, ``vae.decode``) and on-disk layout (``model_index.json``,
one sub-folder per component, ``*.safetensors``, ``tokenizer.json``) as with a real model.

Nothing is downloaded: tokenizers are built from small in-memory vocabularies and every
model from its config with random weights. :func:`build` is deterministic for a given
``(kind, seed, num_layers)``: each component is initialised from its own seed derived from
``(kind, component name, seed)``, under a forked RNG, so the caller's global RNG state is
left untouched and the components do not depend on build order. Everything is float32, on
the CPU, in ``eval()`` mode.

``num_layers=N`` (for layer-wise offload tests, which need many blocks) gives every DiT N
blocks (Flux: N double and N single blocks); :data:`DIT_BLOCKS` and :data:`ENCODER_BLOCKS`
name the block lists and :func:`block_containers` returns them. The default (None) keeps
the depths below and exactly the same weights as before the option existed.

Kinds, pipeline classes and components (``name: class``):

``"wan2.1"``  :class:`~diffusers.WanPipeline`
    ``transformer: WanTransformer3DModel``, ``vae: AutoencoderKLWan``,
    ``text_encoder: UMT5EncoderModel``, ``tokenizer: T5Tokenizer``,
    ``scheduler: UniPCMultistepScheduler`` (flow prediction, ``flow_shift=3``).
``"wan2.2"``  :class:`~diffusers.WanPipeline`
    as ``"wan2.1"`` plus a second, differently initialised ``transformer_2`` and the
    registered config ``boundary_ratio=0.875``. With :func:`default_call_kwargs` the two
    steps run at timesteps 999 (``transformer``) and 750 (``transformer_2``), so both DiTs
    run in one call.
``"wan2.2-i2v"``  :class:`~diffusers.WanImageToVideoPipeline`
    image-to-video laid out like Wan2.2-I2V-A14B: the components of ``"wan2.2"`` (two
    experts, ``boundary_ratio=0.875``), no ``image_encoder`` / ``image_processor`` (the
    image conditions the DiTs through the VAE: ``expand_timesteps=False``), and DiTs with
    ``in_channels=36`` (16 noise + 4 first-frame mask + 16 VAE-encoded image channels).
    :func:`default_call_kwargs` adds a fixed 32x32 RGB ``image``.
``"flux"``  :class:`~diffusers.FluxPipeline`
    ``transformer: FluxTransformer2DModel`` (guidance-distilled, like FLUX.1-dev),
    ``vae: AutoencoderKL``, ``text_encoder: CLIPTextModel``, ``tokenizer: CLIPTokenizer``,
    ``text_encoder_2: T5EncoderModel``, ``tokenizer_2: T5Tokenizer``,
    ``scheduler: FlowMatchEulerDiscreteScheduler``.
``"sd3"``  :class:`~diffusers.StableDiffusion3Pipeline`
    ``transformer: SD3Transformer2DModel``, ``vae: AutoencoderKL``,
    ``text_encoder`` / ``text_encoder_2: CLIPTextModelWithProjection`` (hidden sizes 32 and
    48), ``tokenizer`` / ``tokenizer_2: CLIPTokenizer``, ``text_encoder_3: T5EncoderModel``,
    ``tokenizer_3: T5Tokenizer``, ``scheduler: FlowMatchEulerDiscreteScheduler``.
``"qwen-image"``  :class:`~diffusers.QwenImagePipeline`
    ``transformer: QwenImageTransformer2DModel``, ``vae: AutoencoderKLQwenImage``,
    ``text_encoder: Qwen2_5_VLForConditionalGeneration`` (with its tiny vision tower),
    ``tokenizer: Qwen2Tokenizer``, ``scheduler: FlowMatchEulerDiscreteScheduler``.

All VAEs have 16 latent channels, as the real ones do. With the default depths each model
component holds under 400 KiB of float32 parameters (0.3 to 1.3 MiB per pipeline); a
pipeline builds in about 0.1 s and runs :func:`default_call_kwargs` in about 0.05 s on a
CPU (after warm-up). With ``num_layers=8`` the largest DiT (Flux) is 1.7 MiB.

The tokenizers (byte-level BPE for CLIP and Qwen2, character-level Unigram for T5, with
whole-word entries for common prompt words) are built by :mod:`.tiny_tokenizers`.
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .tiny_tokenizers import (
    CLIP_MAX_LENGTH,
    QWEN_SPECIAL_TOKENS,
    clip_tokenizer,
    qwen2_tokenizer,
    t5_tokenizer,
)

__all__ = [
    "DIT_BLOCKS",
    "ENCODER_BLOCKS",
    "KINDS",
    "block_containers",
    "build",
    "check_num_layers",
    "default_call_kwargs",
    "kind_of",
    "read_marker",
    "save",
]

#: file that marks a folder written by :func:`save`
#: (JSON: ``{"kind": ..., "seed": ..., "num_layers": ...}``, see :func:`read_marker`)
MARKER = "diffusion_offload_tiny.json"

KINDS: tuple[str, ...] = ("wan2.1", "wan2.2", "wan2.2-i2v", "flux", "sd3", "qwen-image")
"""The pipeline kinds :func:`build`, :func:`save` and :func:`default_call_kwargs` accept."""

DIT_BLOCKS: dict[str, tuple[str, ...]] = {
    "wan2.1": ("transformer.blocks",),
    "wan2.2": ("transformer.blocks", "transformer_2.blocks"),
    "wan2.2-i2v": ("transformer.blocks", "transformer_2.blocks"),
    "flux": ("transformer.transformer_blocks", "transformer.single_transformer_blocks"),
    "sd3": ("transformer.transformer_blocks",),
    "qwen-image": ("transformer.transformer_blocks",),
}
"""Per kind, the dotted paths (from the pipeline) of every DiT's ``nn.ModuleList`` of blocks.

Each holds ``num_layers`` blocks when :func:`build` is given ``num_layers``; with the
default depths: Wan 2, Flux 1 (double) and 2 (single), SD3 2, Qwen-Image 2."""

ENCODER_BLOCKS: dict[str, tuple[str, ...]] = {
    "wan2.1": ("text_encoder.encoder.block",),
    "wan2.2": ("text_encoder.encoder.block",),
    "wan2.2-i2v": ("text_encoder.encoder.block",),
    "flux": ("text_encoder.encoder.layers", "text_encoder_2.encoder.block"),
    "sd3": (
        "text_encoder.text_model.encoder.layers",
        "text_encoder_2.text_model.encoder.layers",
        "text_encoder_3.encoder.block",
    ),
    "qwen-image": ("text_encoder.model.language_model.layers", "text_encoder.model.visual.blocks"),
}
"""Per kind, the dotted paths of the text encoders' ``nn.ModuleList`` s of blocks (2 each,
whatever ``num_layers``), as laid out by transformers 5: T5/UMT5 ``encoder.block``;
``CLIPTextModel`` (Flux) ``encoder.layers`` (transformers 5 has no ``text_model`` level
there); ``CLIPTextModelWithProjection`` (SD3) ``text_model.encoder.layers``;
Qwen2.5-VL ``model.language_model.layers`` and its vision tower ``model.visual.blocks``."""



def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {KINDS}")


def _seed_for(kind: str, name: str, seed: int) -> int:
    """A 63-bit seed for one component, derived from ``(kind, name, seed)``."""
    digest = hashlib.sha256(f"{kind}/{name}/{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _seeded(kind: str, name: str, seed: int, factory: Callable[[], Any]) -> Any:
    """Run ``factory`` with the (forked) CPU RNG seeded for component ``name``."""
    torch.manual_seed(_seed_for(kind, name, seed))
    return factory()


# --------------------------------------------------------------------------- text encoders


def _clip_config(vocab_size: int, hidden_size: int, projection_dim: int):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        projection_dim=projection_dim,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=CLIP_MAX_LENGTH,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def _t5_family_encoder(
    umt5: bool, vocab_size: int, d_model: int, d_kv: int, d_ff: int, num_heads: int
):
    """A 2-layer T5 (Flux, SD3) or UMT5 (Wan) encoder with gated-GELU and no dropout."""
    import transformers

    prefix = "UMT5" if umt5 else "T5"
    config = getattr(transformers, f"{prefix}Config")(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=2,
        num_heads=num_heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    )
    return getattr(transformers, f"{prefix}EncoderModel")(config)


def _t5_encoder(vocab_size: int, d_model: int):
    return _t5_family_encoder(False, vocab_size, d_model, d_kv=8, d_ff=64, num_heads=4)


def _umt5_encoder(vocab_size: int):
    return _t5_family_encoder(True, vocab_size, 32, d_kv=16, d_ff=32, num_heads=2)


def _qwen2_5_vl_encoder(tokenizer):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    eos = ids["<|endoftext|>"]
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [1, 1, 2],
            },
            "attention_dropout": 0.0,
            "bos_token_id": eos,
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": eos,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": 32,
            "fullatt_block_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    return Qwen2_5_VLForConditionalGeneration(config)


# --------------------------------------------------------------------------- VAEs, schedulers


def _autoencoder_kl(scaling_factor: float, shift_factor: float):
    """A 2-level :class:`~diffusers.AutoencoderKL`: spatial factor 2, 16 latent channels."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _wan_vae():
    """:class:`~diffusers.AutoencoderKLWan`: spatial factor 8, temporal factor 4, z_dim 16."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=3,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    )


def _wan_scheduler():
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        num_train_timesteps=1000,
    )


def _flow_match_scheduler(**kwargs: Any):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**kwargs)


# --------------------------------------------------------------------------- pipelines


#: latent channels of an image-to-video Wan DiT's input: 16 noise, 4 first-frame mask (one
#: per frame of a temporal group of the VAE), 16 of the VAE-encoded image
_I2V_IN_CHANNELS = 16 + 4 + 16


def _wan_transformer(num_layers: int | None = None, in_channels: int = 16):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=in_channels,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2 if num_layers is None else num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def _build_wan(kind: str, seed: int, num_layers: int | None):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    channels = _I2V_IN_CHANNELS if kind == "wan2.2-i2v" else 16
    tokenizer = t5_tokenizer()
    components: dict[str, Any] = {
        "tokenizer": tokenizer,
        "text_encoder": _seeded(kind, "text_encoder", seed, lambda: _umt5_encoder(len(tokenizer))),
        "transformer": _seeded(
            kind, "transformer", seed, lambda: _wan_transformer(num_layers, channels)
        ),
        "vae": _seeded(kind, "vae", seed, _wan_vae),
        "scheduler": _wan_scheduler(),
    }
    if kind == "wan2.1":
        return WanPipeline(**components)
    components["transformer_2"] = _seeded(
        kind, "transformer_2", seed, lambda: _wan_transformer(num_layers, channels)
    )
    if kind == "wan2.2":
        return WanPipeline(**components, boundary_ratio=0.875)
    # Wan2.2-I2V-A14B: no CLIP image encoder, the image is VAE-encoded into the DiT's input
    return WanImageToVideoPipeline(
        **components, image_encoder=None, image_processor=None, boundary_ratio=0.875,
        expand_timesteps=False,
    )


def _build_flux(kind: str, seed: int, num_layers: int | None):
    from diffusers import FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tokenizer = clip_tokenizer()
    tokenizer_2 = t5_tokenizer()
    return FluxPipeline(
        scheduler=_flow_match_scheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=256,
            max_image_seq_len=4096,
        ),
        vae=_seeded(kind, "vae", seed, lambda: _autoencoder_kl(0.3611, 0.1159)),
        text_encoder=_seeded(
            kind, "text_encoder", seed, lambda: CLIPTextModel(_clip_config(len(tokenizer), 32, 32))
        ),
        tokenizer=tokenizer,
        text_encoder_2=_seeded(
            kind, "text_encoder_2", seed, lambda: _t5_encoder(len(tokenizer_2), 32)
        ),
        tokenizer_2=tokenizer_2,
        transformer=_seeded(
            kind,
            "transformer",
            seed,
            lambda: FluxTransformer2DModel(
                patch_size=1,
                in_channels=64,  # 16 latent channels packed 2x2
                num_layers=1 if num_layers is None else num_layers,
                num_single_layers=2 if num_layers is None else num_layers,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=32,  # T5 d_model
                pooled_projection_dim=32,  # CLIP hidden size
                guidance_embeds=True,
                axes_dims_rope=(4, 6, 6),
            ),
        ),
    )


def _build_sd3(kind: str, seed: int, num_layers: int | None):
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    tokenizer = clip_tokenizer()
    tokenizer_2 = clip_tokenizer()
    tokenizer_3 = t5_tokenizer()
    return StableDiffusion3Pipeline(
        transformer=_seeded(
            kind,
            "transformer",
            seed,
            lambda: SD3Transformer2DModel(
                sample_size=16,
                patch_size=2,
                in_channels=16,
                num_layers=2 if num_layers is None else num_layers,
                attention_head_dim=8,
                num_attention_heads=4,
                joint_attention_dim=96,  # T5 d_model (>= 32 + 48, the CLIP widths)
                caption_projection_dim=32,  # inner dim = heads * head_dim
                pooled_projection_dim=80,  # 32 + 48, the CLIP projections
                out_channels=16,
                pos_embed_max_size=16,
            ),
        ),
        scheduler=_flow_match_scheduler(shift=3.0),
        vae=_seeded(kind, "vae", seed, lambda: _autoencoder_kl(1.5305, 0.0609)),
        text_encoder=_seeded(
            kind,
            "text_encoder",
            seed,
            lambda: CLIPTextModelWithProjection(_clip_config(len(tokenizer), 32, 32)),
        ),
        tokenizer=tokenizer,
        text_encoder_2=_seeded(
            kind,
            "text_encoder_2",
            seed,
            lambda: CLIPTextModelWithProjection(_clip_config(len(tokenizer_2), 48, 48)),
        ),
        tokenizer_2=tokenizer_2,
        text_encoder_3=_seeded(
            kind, "text_encoder_3", seed, lambda: _t5_encoder(len(tokenizer_3), 96)
        ),
        tokenizer_3=tokenizer_3,
    )


def _build_qwen_image(kind: str, seed: int, num_layers: int | None):
    from diffusers import AutoencoderKLQwenImage, QwenImagePipeline, QwenImageTransformer2DModel

    tokenizer = qwen2_tokenizer()
    return QwenImagePipeline(
        scheduler=_flow_match_scheduler(
            shift=1.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=0.9,
            base_image_seq_len=256,
            max_image_seq_len=8192,
            shift_terminal=0.02,
            time_shift_type="exponential",
        ),
        vae=_seeded(
            kind,
            "vae",
            seed,
            lambda: AutoencoderKLQwenImage(
                base_dim=4,
                z_dim=16,
                dim_mult=[1, 1, 1, 1],
                num_res_blocks=1,
                temperal_downsample=[False, True, True],
            ),
        ),
        text_encoder=_seeded(kind, "text_encoder", seed, lambda: _qwen2_5_vl_encoder(tokenizer)),
        tokenizer=tokenizer,
        transformer=_seeded(
            kind,
            "transformer",
            seed,
            lambda: QwenImageTransformer2DModel(
                patch_size=2,
                in_channels=64,  # 16 latent channels packed 2x2
                out_channels=16,
                num_layers=2 if num_layers is None else num_layers,
                attention_head_dim=16,
                num_attention_heads=2,
                joint_attention_dim=32,  # text encoder hidden size
                guidance_embeds=False,
                axes_dims_rope=(4, 6, 6),
            ),
        ),
    )


_BUILDERS: dict[str, Callable[[str, int, int | None], Any]] = {
    "wan2.1": _build_wan,
    "wan2.2": _build_wan,
    "wan2.2-i2v": _build_wan,
    "flux": _build_flux,
    "sd3": _build_sd3,
    "qwen-image": _build_qwen_image,
}


def _modules(pipe: Any) -> Iterable[torch.nn.Module]:
    return (c for c in pipe.components.values() if isinstance(c, torch.nn.Module))


def check_num_layers(num_layers: object) -> int | None:
    """Validate a block count for :func:`build` / :func:`save`; return it as an ``int``.

    Args:
        num_layers: None (each DiT keeps its default depth) or an integer >= 1 (a Python
            ``int`` or any :class:`numbers.Integral`, e.g. a NumPy integer; not a bool).

    Returns:
        None, or ``int(num_layers)``.

    Raises:
        TypeError: ``num_layers`` is not None and not an integer (bools are refused too).
        ValueError: ``num_layers`` is an integer below 1.
    """
    if num_layers is None:
        return None
    if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral):
        raise TypeError(
            f"num_layers must be None or an integer >= 1, got {num_layers!r} "
            f"({type(num_layers).__name__})"
        )
    if num_layers < 1:
        raise ValueError(f"num_layers must be None or an integer >= 1, got {num_layers!r}")
    return int(num_layers)


def build(kind: str, seed: int = 0, num_layers: int | None = None):
    """Build the tiny random-weight pipeline ``kind`` in memory.

    Args:
        kind: one of :data:`KINDS`.
        seed: weights are a pure function of ``(kind, seed, num_layers)``; the caller's
            global torch RNG state is preserved.
        num_layers: None (default) keeps the default depths (Wan 2 blocks, Flux 1 double +
            2 single blocks, SD3 2, Qwen-Image 2), with exactly the weights this function
            has always built for ``(kind, seed)``. An integer N >= 1 gives every DiT N
            blocks: Wan ``transformer.blocks`` (Wan2.2 and Wan2.2 I2V: ``transformer_2.blocks``
            too), Flux
            ``transformer.transformer_blocks`` *and* ``transformer.single_transformer_blocks``,
            SD3 and Qwen-Image ``transformer.transformer_blocks`` (see :data:`DIT_BLOCKS`).
            Text encoders, VAEs and everything else are unchanged. Float32 bytes per
            block: Wan 26 KiB, SD3 and Qwen-Image ~150 KiB (SD3's last, context-only block
            ~95 KiB), Flux 148 KiB double + 61 KiB single; N=8 builds in a fraction of a
            second. The weights depend on ``num_layers`` (an explicit N equal to a default
            depth gives the default weights for Wan, SD3 and Qwen-Image, not for Flux).

    Returns:
        A :class:`diffusers.DiffusionPipeline` (``WanPipeline``, ``WanImageToVideoPipeline``,
        ``FluxPipeline``, ``StableDiffusion3Pipeline`` or ``QwenImagePipeline``) on the CPU, every
        ``torch.nn.Module`` component float32 and in ``eval()`` mode, progress bars
        disabled. Each model component holds at most a few hundred KiB of parameters;
        component names are listed in the module docstring.

    Raises:
        ValueError: ``kind`` is not in :data:`KINDS`, or ``num_layers`` < 1.
        TypeError: ``num_layers`` is neither None nor an integer.
    """
    _check_kind(kind)
    num_layers = check_num_layers(num_layers)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.random.fork_rng(devices=[]):
            pipe = _BUILDERS[kind](kind, seed, num_layers)
    finally:
        torch.set_default_dtype(default_dtype)
    for module in _modules(pipe):
        module.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save(
    kind: str, directory: str | os.PathLike[str], seed: int = 0, num_layers: int | None = None
) -> Path:
    """Build ``kind`` and ``save_pretrained`` it (safetensors) to ``directory``, atomically.

    The pipeline is written to a temporary directory beside ``directory`` (same parent, so
    same file system) and moved into place with :func:`os.replace`. An existing
    ``directory`` is replaced only if it is empty or a pipeline written by this function
    (it holds :data:`MARKER`): it is first renamed aside, then deleted once the new one is
    in place, so readers see either the old or the new complete pipeline, never a partial
    one. Any other existing directory is refused, never deleted. Missing parent
    directories are created. The result loads offline with
    ``DiffusionPipeline.from_pretrained(directory)`` and carries :data:`MARKER`, a JSON file
    ``{"kind": str, "seed": int, "num_layers": int | null}`` (see :func:`kind_of` and
    :func:`read_marker`). The block counts also live in each DiT's own ``config.json``
    (``num_layers``, and Flux's ``num_single_layers``), so the folder loads back with them.

    Args:
        kind: one of :data:`KINDS`.
        directory: where the pipeline folder (``model_index.json`` and one sub-folder per
            component) ends up.
        seed: as for :func:`build`.
        num_layers: as for :func:`build` (None: the default depths).

    Returns:
        ``Path(directory)``.

    Raises:
        ValueError: ``kind`` is not in :data:`KINDS`, or ``num_layers`` < 1 (nothing is
            written).
        TypeError: ``num_layers`` is neither None nor an integer (nothing is written).
        FileExistsError: ``directory`` exists, is not empty and is not a tiny pipeline.
        OSError: the directory cannot be written or replaced (e.g. ``directory`` is an
            existing file: :class:`NotADirectoryError`); the temporary directory is removed.
    """
    _check_kind(kind)
    num_layers = check_num_layers(num_layers)
    target = Path(directory)
    if target.is_dir() and any(target.iterdir()) and not (target / MARKER).is_file():
        raise FileExistsError(
            f"{str(target)!r} exists and is not empty; refusing to replace a folder that is "
            "not a tiny pipeline (choose a new or empty folder)"
        )
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{str(target)!r} exists and is not a folder")
    pipe = build(kind, seed, num_layers)
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        marker = {"kind": kind, "seed": int(seed), "num_layers": num_layers}
        (tmp / MARKER).write_text(json.dumps(marker))
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _replace_dir(src: Path, dst: Path) -> None:
    """``os.replace(src, dst)``, first moving an existing non-empty directory ``dst`` aside."""
    try:
        os.replace(src, dst)
        return
    except OSError:
        if not dst.is_dir() or dst.is_symlink():
            raise
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    try:
        try:
            os.replace(dst, aside / dst.name)
        except FileNotFoundError:  # a concurrent save moved it first
            pass
        os.replace(src, dst)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def kind_of(directory: str | os.PathLike[str]) -> str | None:
    """The kind of a pipeline folder written by :func:`save`, or None for any other folder."""
    marker = read_marker(directory)
    return None if marker is None else marker["kind"]


def read_marker(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What :func:`save` recorded about a pipeline folder, or None for any other folder.

    Returns:
        ``{"kind": str, "seed": int | None, "num_layers": int | None}``: ``kind`` is in
        :data:`KINDS`; ``seed`` is None when not recorded; ``num_layers`` is None for the
        default depths (also for folders written before the key existed). None when
        :data:`MARKER` is missing, unreadable, not a JSON object or names no known kind.
        A malformed ``seed`` or ``num_layers`` reads as None.
    """
    try:
        data = json.loads((Path(directory) / MARKER).read_text())
        kind = data["kind"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(kind, str) or kind not in KINDS:
        return None

    def integer(value: object, minimum: int) -> int | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
        return value if ok else None  # type: ignore[return-value]

    return {
        "kind": kind,
        "seed": integer(data.get("seed"), 0),
        "num_layers": integer(data.get("num_layers"), 1),
    }


def block_containers(
    pipe: Any, kind: str, encoders: bool = False
) -> dict[str, torch.nn.ModuleList]:
    """The block lists of a pipeline built by :func:`build` (or loaded from :func:`save`).

    Args:
        pipe: a pipeline of kind ``kind``.
        kind: one of :data:`KINDS`.
        encoders: also include the text encoders' block lists (:data:`ENCODER_BLOCKS`).

    Returns:
        ``{dotted path: nn.ModuleList}`` in the order of :data:`DIT_BLOCKS` (then
        :data:`ENCODER_BLOCKS`); paths start at the pipeline's component names.

    Raises:
        ValueError: ``kind`` is not in :data:`KINDS`.
        AttributeError: ``pipe`` lacks one of the paths (not a pipeline of this kind).
        TypeError: a path does not lead to an ``nn.ModuleList``.
    """
    _check_kind(kind)
    paths = DIT_BLOCKS[kind] + (ENCODER_BLOCKS[kind] if encoders else ())
    out: dict[str, torch.nn.ModuleList] = {}
    for path in paths:
        obj = pipe
        for part in path.split("."):
            obj = getattr(obj, part)
        if not isinstance(obj, torch.nn.ModuleList):
            raise TypeError(f"{path} is a {type(obj).__name__}, not an nn.ModuleList")
        out[path] = obj
    return out


def _reference_image() -> Any:
    """A 32x32 RGB ``PIL.Image``: a fixed pattern of colours (no randomness)."""
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:32, 0:32]
    pixels = np.stack([x * 8, y * 8, (x + y) * 4 % 256], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels)


def default_call_kwargs(kind: str) -> dict[str, Any]:
    """Keyword arguments for ``pipe(prompt=..., **kwargs)`` that make a fast, valid run.

    Two inference steps at 32x32 (video kinds: 5 frames, 2 latent frames), text at most 16
    tokens, and the guidance knob of each pipeline set so that classifier-free guidance is
    on when a ``negative_prompt`` is given (Flux: embedded guidance only). ``output_type``
    is not included. Resulting outputs: Wan ``frames`` ``(1, 5, 32, 32, 3)`` for
    ``output_type="np"``; image kinds ``images`` ``(1, 32, 32, 3)``.

    For ``"wan2.2"`` and ``"wan2.2-i2v"`` the two steps run at timesteps 999 and 750, on
    either side of the boundary (875), so ``transformer`` and ``transformer_2`` each run
    once. ``"wan2.2-i2v"`` also gets ``image``: a new 32x32 RGB ``PIL.Image`` (a fixed
    colour pattern, the same pixels on every call) that becomes the first frame.

    Returns:
        A new dict on every call.

    Raises:
        ValueError: ``kind`` is not in :data:`KINDS`.
    """
    _check_kind(kind)
    common: dict[str, Any] = {"height": 32, "width": 32, "num_inference_steps": 2}
    if kind == "wan2.1":
        return {**common, "num_frames": 5, "guidance_scale": 5.0, "max_sequence_length": 16}
    if kind in ("wan2.2", "wan2.2-i2v"):
        wan22 = {
            **common,
            "num_frames": 5,
            "guidance_scale": 4.0,
            "guidance_scale_2": 3.0,
            "max_sequence_length": 16,
        }
        return wan22 if kind == "wan2.2" else {**wan22, "image": _reference_image()}
    if kind == "flux":
        return {**common, "guidance_scale": 3.5, "max_sequence_length": 16}
    if kind == "sd3":
        return {**common, "guidance_scale": 5.0, "max_sequence_length": 16}
    return {**common, "true_cfg_scale": 4.0, "max_sequence_length": 16}  # qwen-image
