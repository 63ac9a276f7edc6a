"""Layer mode streams every text encoder diffusers' pipelines name (issue 38, item 7).

``test_every_text_encoder_class_is_walked`` collects, from the ``__init__`` type hints of
every pipeline class diffusers exports, the classes of the components the role table
calls text encoders (``diffusers_role(name) == "text_encoder"``); each is built here from
a tiny config (a vocabulary of ``VOCAB`` tokens: as in real checkpoints, and in diffusers'
own testers, the token table outweighs the few layers) and, in
``test_layer_mode_streams_the_text_encoder``, discovered by structure alone (no table
row), streamed in layer mode and compared with the all-resident run on the fake device:
bit-equal, every block streamed, blocks in the order they run (no fallback load), no
race. Kandinsky's prior (``PriorTransformer``, a DiT) is checked the same way, and the
tiny Flux2-Klein family (``Qwen3ForCausalLM``) runs whole with its text encoder streamed.
"""

from __future__ import annotations

import gc
import inspect
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from diffusion_offload import LayerwiseOffloadBackend
from diffusion_offload.core.blocks import (
    BUILTIN_BLOCK_ATTRS,
    block_attrs,
    discover_blocks,
    discovered_block_attrs,
    token_embedding_path,
)
from diffusion_offload.core.discovery import SupportsComponentDiscovery, diffusers_role
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_families
from diffusion_offload.testing.pytest_plugin import requires_fake

pytestmark = [pytest.mark.filterwarnings("ignore")]

#: the tiny vocabulary (the token table then holds most of a tiny model's bytes)
VOCAB = 1000


def _llm(**overrides: Any) -> dict[str, Any]:
    """A tiny decoder LLM config (2 layers, hidden 16)."""
    config = dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )
    config.update(overrides)
    return config


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    return ids, mask


def _call_ids(model: nn.Module, device: torch.device) -> Any:
    ids, mask = _tokens()
    return model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)


def _call_vits(model: nn.Module, device: torch.device) -> Any:
    ids, _ = _tokens()
    torch.manual_seed(0)  # the duration predictor and the flow draw noise
    return model(input_ids=ids.to(device))


def _call_clap(model: nn.Module, device: torch.device) -> Any:
    ids, mask = _tokens()
    return model.get_text_features(input_ids=ids.to(device), attention_mask=mask.to(device))


def _call_ctx_clip(model: nn.Module, device: torch.device) -> Any:
    ids, _ = _tokens()
    ctx = torch.randn(2, 2, 16, generator=torch.Generator().manual_seed(1)).to(device)
    return model(ctx_embeddings=ctx, ctx_begin_pos=[2, 2], input_ids=ids.to(device))


def _call_chatglm(model: nn.Module, device: torch.device) -> Any:
    ids, mask = _tokens()
    position_ids = torch.arange(ids.shape[1]).expand_as(ids)
    return model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=position_ids.to(device),
                 output_hidden_states=True)


def _call_mclip(model: nn.Module, device: torch.device) -> Any:
    ids, mask = _tokens()
    return model(input_ids=ids.to(device), attention_mask=mask.to(device))


def _call_prior(model: nn.Module, device: torch.device) -> Any:
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 32, generator=g)
    proj = torch.randn(1, 32, generator=g)
    states = torch.randn(1, 77, 32, generator=g)
    mask = torch.ones(1, 77, dtype=torch.bool)
    return model(latents.to(device), timestep=3, proj_embedding=proj.to(device),
                 encoder_hidden_states=states.to(device), attention_mask=mask.to(device))


def _transformers(name: str) -> type:
    import transformers

    return getattr(transformers, name)


def _decoder(model_cls: str, config_cls: str, **overrides: Any) -> Callable[[], nn.Module]:
    return lambda: _transformers(model_cls)(_transformers(config_cls)(**_llm(**overrides)))


def _vlm(model_cls: str, config_cls: str, text: dict[str, Any], vision: dict[str, Any], **extra: Any):
    return lambda: _transformers(model_cls)(_transformers(config_cls)(text_config=text, vision_config=vision, **extra))


def _bert() -> nn.Module:
    import transformers

    return transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32))


def _clip(cls: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return _transformers(cls)(transformers.CLIPTextConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            projection_dim=8, max_position_embeddings=16))

    return build


def _clap_text() -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                projection_dim=8, max_position_embeddings=40)


def _clap_text_model() -> nn.Module:
    import transformers

    return transformers.ClapTextModelWithProjection(transformers.ClapTextConfig(**_clap_text()))


def _clap_model() -> nn.Module:
    import transformers

    audio = dict(hidden_size=16, patch_embeds_hidden_size=8, depths=[1, 1], num_attention_heads=[2, 2],
                 window_size=4, spec_size=32, num_mel_bins=16, projection_dim=8, enable_fusion=False,
                 patch_stride=(4, 4))
    return transformers.ClapModel(transformers.ClapConfig(
        text_config=_clap_text(), audio_config=audio, projection_dim=8))


def _gpt2() -> nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2,
                                                                n_positions=64))


def _t5(cls: str, config: str) -> Callable[[], nn.Module]:
    return lambda: _transformers(cls)(_transformers(config)(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8))


_GEMMA_TEXT = dict(_llm(), model_type="gemma3_text", sliding_window=8)
_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
               num_attention_heads=2, image_size=16, patch_size=8)
_QWEN_VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16,
                    spatial_merge_size=1, patch_size=2, temporal_patch_size=1, in_channels=3)
_MROPE = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}


def _t5gemma_module() -> dict[str, Any]:
    return dict(_llm(), sliding_window=8, query_pre_attn_scalar=8, dropout_rate=0.0)


def _t5gemma_encoder() -> nn.Module:
    from transformers.models.t5gemma.configuration_t5gemma import T5GemmaModuleConfig
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

    return T5GemmaEncoder(T5GemmaModuleConfig(**_t5gemma_module()))


def _t5gemma_encoder_model() -> nn.Module:
    import transformers

    module = _t5gemma_module()
    return transformers.T5GemmaEncoderModel(transformers.T5GemmaConfig(encoder=module, decoder=module,
                                                                       is_encoder_decoder=False))


def _t5gemma2_encoder() -> nn.Module:
    from transformers.models.t5gemma2.configuration_t5gemma2 import T5Gemma2EncoderConfig
    from transformers.models.t5gemma2.modeling_t5gemma2 import T5Gemma2Encoder

    text = dict(_GEMMA_TEXT, model_type="t5gemma2_text", dropout_rate=0.0)
    return T5Gemma2Encoder(T5Gemma2EncoderConfig(text_config=text, vision_config=_SIGLIP, mm_tokens_per_image=4))


def _gemma4() -> nn.Module:
    import transformers

    text = dict(_llm(), sliding_window=8, layer_types=["sliding_attention", "full_attention"], global_head_dim=8)
    tokens = dict(image_token_id=VOCAB - 1, boi_token_id=VOCAB - 2, eoi_token_id=VOCAB - 3, video_token_id=VOCAB - 4,
                  boa_token_id=VOCAB - 5, eoa_token_index=VOCAB - 6, audio_token_id=VOCAB - 7)
    return transformers.Gemma4UnifiedForConditionalGeneration(transformers.Gemma4UnifiedConfig(
        text_config=text, vision_config=None, audio_config=None, **tokens))


def _vits() -> nn.Module:
    import transformers

    return transformers.VitsModel(transformers.VitsConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
        flow_size=8, spectrogram_bins=9, upsample_initial_channel=8, upsample_rates=[2], upsample_kernel_sizes=[4],
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1]], prior_encoder_num_flows=1,
        prior_encoder_num_wavenet_layers=1, posterior_encoder_num_wavenet_layers=1,
        duration_predictor_filter_channels=8, depth_separable_num_layers=1, window_size=2))


def _mclip() -> nn.Module:
    from diffusers.pipelines.kandinsky.text_encoder import MCLIPConfig, MultilingualCLIP

    # Kandinsky 2.1's tester config, its 1005 tokens included
    return MultilingualCLIP(MCLIPConfig(numDims=32, transformerDimensions=32, hidden_size=32, intermediate_size=37,
                                        num_attention_heads=4, num_hidden_layers=5, vocab_size=1005))


def _roberta_series() -> nn.Module:
    from diffusers.pipelines.deprecated.alt_diffusion.modeling_roberta_series import (
        RobertaSeriesConfig,
        RobertaSeriesModelWithTransformation,
    )

    return RobertaSeriesModelWithTransformation(RobertaSeriesConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        project_dim=8, max_position_embeddings=40))


def _ctx_clip() -> nn.Module:
    from diffusers.pipelines.deprecated.blip_diffusion.modeling_ctx_clip import ContextCLIPTextModel
    from transformers import CLIPTextConfig

    return ContextCLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16))


def _chatglm() -> nn.Module:
    from diffusers.pipelines.kolors.text_encoder import ChatGLMConfig, ChatGLMModel

    model = ChatGLMModel(ChatGLMConfig(num_layers=2, padded_vocab_size=VOCAB, hidden_size=16, ffn_hidden_size=32,
                                       kv_channels=8, num_attention_heads=2, seq_length=32, multi_query_attention=True,
                                       multi_query_group_num=1, add_qkv_bias=True, original_rope=True),
                         empty_init=False)
    with torch.no_grad():  # its RMSNorm weights are torch.empty until a checkpoint loads
        for sub in model.modules():
            if type(sub).__name__ == "RMSNorm":
                sub.weight.fill_(1.0)
    return model


def _ldm_bert() -> nn.Module:
    from diffusers.pipelines.latent_diffusion.pipeline_latent_diffusion import LDMBertConfig, LDMBertModel

    return LDMBertModel(LDMBertConfig(vocab_size=VOCAB, max_position_embeddings=16, encoder_layers=2,
                                      encoder_ffn_dim=32, encoder_attention_heads=2, head_dim=8, d_model=16))


def _prior() -> nn.Module:
    from diffusers import PriorTransformer

    # Kandinsky 2.1 / 2.2 priors' tester config: one block, a 81 x 81 causal mask buffer
    return PriorTransformer(num_attention_heads=2, attention_head_dim=12, embedding_dim=32, num_layers=1)


@pytest.fixture(autouse=True)
def _frees_the_device() -> Any:
    """Each test leaves nothing on the fake device (the compatibility matrix checks this)."""
    yield
    gc.collect()
    if fa.is_installed():
        assert fa.stats()["allocated_bytes"] == 0


@dataclass(frozen=True)
class Spec:
    """How to build one class tiny, call it, and where its blocks are."""

    build: Callable[[], nn.Module]
    call: Callable[[nn.Module, torch.device], Any]
    containers: tuple[str, ...]
    blocks: int
    #: on-demand loads over the two calls: ClapModel runs through ``get_text_features``,
    #: not ``forward``, so no stage start prefetches the first call's first block
    fallback_loads: int = 0


SPECS: dict[str, Spec] = {
    # transformers text encoders
    "BertModel": Spec(_bert, _call_ids, ("encoder.layer",), 2),
    "CLIPTextModel": Spec(_clip("CLIPTextModel"), _call_ids, ("encoder.layers",), 2),
    "CLIPTextModelWithProjection": Spec(_clip("CLIPTextModelWithProjection"), _call_ids,
                                        ("text_model.encoder.layers",), 2),
    "ClapModel": Spec(_clap_model, _call_clap, ("text_model.encoder.layer",), 2, fallback_loads=1),
    "ClapTextModelWithProjection": Spec(_clap_text_model, _call_ids, ("text_model.encoder.layer",), 2),
    "GPT2LMHeadModel": Spec(_gpt2, _call_ids, ("transformer.h",), 2),
    "GemmaModel": Spec(_decoder("GemmaModel", "GemmaConfig"), _call_ids, ("layers",), 2),
    "GemmaForCausalLM": Spec(_decoder("GemmaForCausalLM", "GemmaConfig"), _call_ids, ("model.layers",), 2),
    "Gemma2Model": Spec(_decoder("Gemma2Model", "Gemma2Config"), _call_ids, ("layers",), 2),
    "Gemma2ForCausalLM": Spec(_decoder("Gemma2ForCausalLM", "Gemma2Config"), _call_ids, ("model.layers",), 2),
    "Gemma3ForConditionalGeneration": Spec(
        _vlm("Gemma3ForConditionalGeneration", "Gemma3Config", _GEMMA_TEXT, _SIGLIP, mm_tokens_per_image=4),
        _call_ids, ("model.language_model.layers",), 2),
    "Gemma4UnifiedForConditionalGeneration": Spec(_gemma4, _call_ids, ("model.language_model.layers",), 2),
    "GlmModel": Spec(_decoder("GlmModel", "GlmConfig", partial_rotary_factor=0.5), _call_ids, ("layers",), 2),
    "LlamaModel": Spec(_decoder("LlamaModel", "LlamaConfig"), _call_ids, ("layers",), 2),
    "LlamaForCausalLM": Spec(_decoder("LlamaForCausalLM", "LlamaConfig"), _call_ids, ("model.layers",), 2),
    "LlavaForConditionalGeneration": Spec(
        _vlm("LlavaForConditionalGeneration", "LlavaConfig", dict(_llm(), model_type="llama"),
             dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, image_size=16, patch_size=8, projection_dim=16),
             image_token_id=VOCAB - 1),
        _call_ids, ("model.language_model.layers",), 2),
    "Mistral3Model": Spec(
        _vlm("Mistral3Model", "Mistral3Config", dict(_llm(), model_type="mistral", sliding_window=None),
             dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, image_size=24, patch_size=6), image_token_index=VOCAB - 1),
        _call_ids, ("language_model.layers",), 2),
    "Mistral3ForConditionalGeneration": Spec(
        _vlm("Mistral3ForConditionalGeneration", "Mistral3Config", dict(_llm(), model_type="mistral", sliding_window=None),
             dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32, image_size=24, patch_size=6), image_token_index=VOCAB - 1),
        _call_ids, ("model.language_model.layers",), 2),
    "Qwen2VLForConditionalGeneration": Spec(
        _vlm("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", dict(_llm(), rope_parameters=_MROPE),
             dict(depth=1, embed_dim=16, hidden_size=16, mlp_ratio=2, num_heads=2, spatial_merge_size=1,
                  patch_size=2, temporal_patch_size=1), image_token_id=VOCAB - 1, video_token_id=VOCAB - 2),
        _call_ids, ("model.language_model.layers",), 2),
    "Qwen2_5_VLForConditionalGeneration": Spec(
        _vlm("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig", dict(_llm(), rope_parameters=_MROPE),
             _QWEN_VISION, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2),
        _call_ids, ("model.language_model.layers",), 2),
    "Qwen2_5_VLTextModel": Spec(_decoder("Qwen2_5_VLTextModel", "Qwen2_5_VLTextConfig", rope_parameters=_MROPE),
                                _call_ids, ("layers",), 2),
    "Qwen3Model": Spec(_decoder("Qwen3Model", "Qwen3Config"), _call_ids, ("layers",), 2),
    "Qwen3ForCausalLM": Spec(_decoder("Qwen3ForCausalLM", "Qwen3Config"), _call_ids, ("model.layers",), 2),
    "Qwen3VLModel": Spec(
        _vlm("Qwen3VLModel", "Qwen3VLConfig", dict(_llm(), rope_parameters=dict(_MROPE, mrope_interleaved=True)),
             dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16,
                  deepstack_visual_indexes=[0]), image_token_id=VOCAB - 1, video_token_id=VOCAB - 2),
        _call_ids, ("language_model.layers",), 2),
    "Qwen3VLForConditionalGeneration": Spec(
        _vlm("Qwen3VLForConditionalGeneration", "Qwen3VLConfig",
             dict(_llm(), rope_parameters=dict(_MROPE, mrope_interleaved=True)),
             dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16, patch_size=2,
                  spatial_merge_size=1, temporal_patch_size=1, num_position_embeddings=16,
                  deepstack_visual_indexes=[0]), image_token_id=VOCAB - 1, video_token_id=VOCAB - 2),
        _call_ids, ("model.language_model.layers",), 2),
    "SmolLM3ForCausalLM": Spec(_decoder("SmolLM3ForCausalLM", "SmolLM3Config"), _call_ids, ("model.layers",), 2),
    "T5EncoderModel": Spec(_t5("T5EncoderModel", "T5Config"), _call_ids, ("encoder.block",), 2),
    "UMT5EncoderModel": Spec(_t5("UMT5EncoderModel", "UMT5Config"), _call_ids, ("encoder.block",), 2),
    "T5GemmaEncoder": Spec(_t5gemma_encoder, _call_ids, ("layers",), 2),
    "T5GemmaEncoderModel": Spec(_t5gemma_encoder_model, _call_ids, ("encoder.layers",), 2),
    "T5Gemma2Encoder": Spec(_t5gemma2_encoder, _call_ids, ("text_model.layers",), 2),
    "VitsModel": Spec(_vits, _call_vits, ("text_encoder.encoder.layers",), 2),
    # diffusers' own text encoders
    "ChatGLMModel": Spec(_chatglm, _call_chatglm, ("encoder.layers",), 2),
    "ContextCLIPTextModel": Spec(_ctx_clip, _call_ctx_clip, ("text_model.encoder.layers",), 2),
    "LDMBertModel": Spec(_ldm_bert, _call_ids, ("model.layers",), 2),
    "MultilingualCLIP": Spec(_mclip, _call_mclip, ("transformer.encoder.layer",), 5),
    "RobertaSeriesModelWithTransformation": Spec(_roberta_series, _call_ids, ("roberta.encoder.layer",), 2),
    # Kandinsky 2.1 / 2.2's prior (a DiT)
    "PriorTransformer": Spec(_prior, _call_prior, ("transformer_blocks",), 1),
}
"""Class name -> its tiny build, its call, its block containers and block count."""

#: annotations that name no class (``PreTrainedModel``: the pipeline takes any model) ->
#: the classes the pipelines' docstrings and checkpoints use, built above
GENERIC = {
    "AceStepPipeline.text_encoder": "Qwen3Model",  # Qwen3-Embedding
    "ZImagePipeline.text_encoder": "Qwen3Model",
    "LDMTextToImagePipeline.bert": "LDMBertModel",
}

#: components the role table calls text encoders that hold no blocks to stream: one
#: projection (layer mode refuses them with "has no discoverable blocks"; select them out)
NO_BLOCKS = {"AudioLDM2ProjectionModel", "StableAudioProjectionModel"}


def _annotated_text_encoders() -> dict[str, set[str]]:
    """Class name -> the ``Pipeline.component`` slots annotated with it, over every
    pipeline class diffusers exports; an abstract ``XPreTrainedModel`` annotation stands
    for its family's base model and CausalLM classes; ``PreTrainedModel`` for none."""
    import diffusers
    import transformers

    out: dict[str, set[str]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(dir(diffusers)):
            if not name.endswith("Pipeline"):
                continue
            cls = getattr(diffusers, name)
            if not inspect.isclass(cls):
                continue
            try:
                hints = typing.get_type_hints(cls.__init__)
            except Exception:  # an unresolvable annotation: the signature's raw ones
                hints = {p.name: p.annotation for p in inspect.signature(cls.__init__).parameters.values()}
            for param, hint in hints.items():
                if diffusers_role(param) != "text_encoder":
                    continue
                for ann in typing.get_args(hint) or (hint,):
                    if not (inspect.isclass(ann) and issubclass(ann, nn.Module)):
                        continue
                    names = [ann.__name__]
                    if ann.__name__.endswith("PreTrainedModel") and ann.__name__ != "PreTrainedModel":
                        family = ann.__name__[: -len("PreTrainedModel")]
                        names = [n for n in (f"{family}Model", f"{family}ForCausalLM")
                                 if issubclass(getattr(transformers, n, object), ann)]
                    for n in names:
                        out.setdefault(n, set()).add(f"{name}.{param}")
    return out


def test_every_text_encoder_class_is_walked():
    """Every class annotated on a text-encoder slot of a diffusers pipeline is built and
    checked here (or has no blocks, or names no class)."""
    found = _annotated_text_encoders()
    assert len(found) >= 35
    generic = found.pop("PreTrainedModel")
    assert {slot for slot in generic if slot in GENERIC} == set(GENERIC)
    assert sorted(set(found) - set(SPECS) - NO_BLOCKS) == []
    # the classes of issue 38 item 7 (Gemma2ForCausalLM: Sana's Gemma2PreTrainedModel)
    for name in ("Qwen3ForCausalLM", "Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration",
                 "Qwen2_5_VLTextModel", "Gemma2ForCausalLM", "MultilingualCLIP"):
        assert name in found, name
    assert "SanaPAGPipeline.text_encoder" in found["Gemma2ForCausalLM"]
    assert "Flux2KleinPipeline.text_encoder" in found["Qwen3ForCausalLM"]


@pytest.fixture(scope="module")
def built() -> dict[str, nn.Module]:
    """Every class of ``SPECS``, built once (seeded) on the host."""
    out = {}
    for name, spec in SPECS.items():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[name] = spec.build().eval()
    return out


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out.detach().cpu()]
    if isinstance(out, dict):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (list, tuple)):
        return [t for v in out for t in _tensors(v)]
    return []


class _Encoder(nn.Module, SupportsComponentDiscovery):
    """A pipeline of one text encoder."""

    _encoder_modules: ClassVar[list[str]] = ["text_encoder"]

    def __init__(self, text_encoder: nn.Module) -> None:
        super().__init__()
        self.text_encoder = text_encoder


class _Prior(nn.Module, SupportsComponentDiscovery):
    _dit_modules: ClassVar[list[str]] = ["prior"]

    def __init__(self, prior: nn.Module) -> None:
        super().__init__()
        self.prior = prior


def test_structure_agrees_with_the_table_rows_of_text_encoders(built):
    """The table rows of transformers text encoders say what structure finds alone."""
    checked = []
    for name, model in built.items():
        if name in BUILTIN_BLOCK_ATTRS:
            assert block_attrs(model) == (discovered_block_attrs(model), "table"), name
            checked.append(name)
    assert sorted(checked) == [
        "CLIPTextModel", "CLIPTextModelWithProjection", "Gemma2Model", "GemmaModel", "GlmModel", "LlamaForCausalLM",
        "LlamaModel", "Mistral3ForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3Model",
        "T5EncoderModel", "UMT5EncoderModel",
    ]


@requires_fake
@pytest.mark.parametrize("name", list(SPECS))
def test_layer_mode_streams_the_text_encoder(fake_device, built, name):
    spec = SPECS[name]
    model = built[name]
    assert discovered_block_attrs(model) == spec.containers
    if name != "PriorTransformer":
        assert token_embedding_path(model) is not None
    blocks = discover_blocks(model)
    assert len(blocks) == spec.blocks
    with torch.no_grad():
        reference = _tensors(spec.call(model.to(fake_device), fake_device))
    model.to("cpu")
    fa.reset_stats()
    is_prior = name == "PriorTransformer"
    pipe = _Prior(model) if is_prior else _Encoder(model)
    component = "prior" if is_prior else "text_encoder"
    backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit" if is_prior else "text_encoder"]},
                                      fake_device)
    backend.enable(pipe)
    try:
        assert [b.name for b in backend.streamer.sequences[component]] == [n for n, _ in blocks]
        for call in range(2):
            with torch.no_grad():
                out = _tensors(spec.call(model, fake_device))
            assert len(out) == len(reference) > 0
            assert all(bool(torch.isfinite(t).all()) for t in reference if t.is_floating_point()), name
            for got, want in zip(out, reference):
                assert torch.equal(got, want), (name, call)
            assert backend.audit() == []
        streamed = sum(backend.components[f"{component}.{n}"].evictable_bytes for n, _ in blocks)
        assert backend.stats.h2d_bytes >= 2 * streamed > 0
        assert backend.stats.fallback_loads == spec.fallback_loads and backend.stats.d2h_bytes == 0
        assert fa.stats()["races_detected"] == 0
    finally:
        backend.disable()
        model.to("cpu")  # disable() leaves the trunk on the device; the fixture keeps the model


@requires_fake
def test_flux2_klein_loaded_back_streams_its_causal_lm_text_encoder(fake_device, tmp_path):
    """Issue 38 item 7's first row: tiny Flux2-Klein, saved with ``save_pretrained`` and
    loaded back, runs in layer mode with its ``Qwen3ForCausalLM`` text encoder streamed
    (``model.layers``) beside its DiT, equal to the all-resident run, twice."""
    from diffusers import DiffusionPipeline

    pipe = tiny_families.build("flux2-klein")
    assert block_attrs(pipe.text_encoder) == (("model.layers",), "discovered")
    reference = tiny_families.run("flux2-klein", pipe.to(fake_device))
    pipe.to("cpu").save_pretrained(tmp_path)
    loaded = DiffusionPipeline.from_pretrained(tmp_path)
    loaded.set_progress_bar_config(disable=True)
    assert type(loaded).__name__ == "Flux2KleinPipeline"
    assert type(loaded.text_encoder).__name__ == "Qwen3ForCausalLM"
    fa.reset_stats()
    backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit", "text_encoder"]}, fake_device)
    backend.enable(loaded)
    try:
        names = {c: [b.name for b in seq] for c, seq in backend.streamer.sequences.items()}
        assert names == {
            "text_encoder": ["model.layers.0", "model.layers.1"],
            "transformer": ["transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1"],
        }
        for _ in range(2):
            out = tiny_families.run("flux2-klein", loaded)
            assert torch.equal(out, reference)
            assert backend.audit() == []
        assert backend.stats.fallback_loads == 0 and backend.stats.d2h_bytes == 0
        assert fa.stats()["races_detected"] == 0
    finally:
        backend.disable()


def _kandinsky_prior() -> Any:
    """A tiny ``KandinskyPriorPipeline`` (diffusers' tester sizes: a one-block prior beside
    its 81 x 81 causal-mask buffer, CLIP text and image encoders)."""
    import transformers
    from diffusers import KandinskyPriorPipeline, PriorTransformer, UnCLIPScheduler

    from diffusion_offload.testing.tiny_tokenizers import clip_tokenizer

    tokenizer = clip_tokenizer()
    torch.manual_seed(0)
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=12, embedding_dim=32, num_layers=1)
    with torch.no_grad():  # a zero clip_std would make every image embedding 0
        prior.clip_std.fill_(1.0)
    torch.manual_seed(0)
    text_encoder = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, projection_dim=32, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77)).eval()
    torch.manual_seed(0)
    image_encoder = transformers.CLIPVisionModelWithProjection(transformers.CLIPVisionConfig(
        hidden_size=32, projection_dim=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
        image_size=32, patch_size=8)).eval()
    scheduler = UnCLIPScheduler(variance_type="fixed_small_log", prediction_type="sample", num_train_timesteps=1000,
                                clip_sample=True, clip_sample_range=10.0)
    pipe = KandinskyPriorPipeline(
        prior=prior, image_encoder=image_encoder, text_encoder=text_encoder, tokenizer=tokenizer,
        scheduler=scheduler, image_processor=transformers.CLIPImageProcessor(crop_size=32, size=32))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run_kandinsky_prior(pipe: Any) -> torch.Tensor:
    out = pipe(prompt="a cat", num_inference_steps=2, guidance_scale=4.0,
               generator=torch.Generator().manual_seed(0), output_type="pt")
    return torch.cat([out.image_embeds, out.negative_image_embeds]).cpu()


@requires_fake
def test_kandinsky_prior_streams_its_prior_and_text_encoder(fake_device):
    """The Kandinsky 2.1 / 2.2 prior pipeline: its ``PriorTransformer`` (role ``dit``) and
    its CLIP text encoder both stream in layer mode, equal to the all-resident run, twice;
    the image encoder (zero-image embeddings) stays resident."""
    reference = _run_kandinsky_prior(_kandinsky_prior().to(fake_device))
    pipe = _kandinsky_prior()
    fa.reset_stats()
    backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit", "text_encoder"]}, fake_device)
    backend.enable(pipe)
    try:
        names = {c: [b.name for b in seq] for c, seq in backend.streamer.sequences.items()}
        assert names == {"prior": ["transformer_blocks.0"],
                         "text_encoder": ["text_model.encoder.layers.0", "text_model.encoder.layers.1"]}
        for _ in range(2):
            out = _run_kandinsky_prior(pipe)
            assert out.shape == (2, 32) and torch.equal(out, reference)
            assert backend.audit() == []
        assert backend.stats.fallback_loads == 0 and backend.stats.d2h_bytes == 0
        assert fa.stats()["races_detected"] == 0
    finally:
        backend.disable()
