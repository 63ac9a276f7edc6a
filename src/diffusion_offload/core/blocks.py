"""Block discovery for layer mode: which submodules of a component are streamed blocks.

A component's blocks are the children, in order, of its block containers (``nn.ModuleList``
or ``nn.Sequential``). The containers are found, in this order of precedence:

1. an override passed by the caller (``layer_blocks={"transformer": ["blocks"]}``);
2. the class attribute ``_layerwise_offload_blocks_attrs: ClassVar[list[str]]`` declared
   by the component's class (dotted paths allowed);
3. the built-in table ``BUILTIN_BLOCK_ATTRS`` below, matched by class name along the MRO,
   so subclasses match too;
4. discovery by structure (``discovered_block_attrs``): for a UNet (``down_blocks`` and
   ``up_blocks`` containers) its down blocks, mid block and up blocks; for a model that
   embeds tokens (every transformers text encoder: CausalLM and conditional-generation
   wrappers, vision-language models, T5, CLIP, Kandinsky's ``MultilingualCLIP``...) the
   repeated containers of the nearest module above its token table (``model.layers``,
   ``model.language_model.layers``; a vision tower stays in the trunk); otherwise the
   outermost ``nn.ModuleList`` / ``nn.Sequential`` containers whose children repeat one
   class (or hold one composite block), each holding at least 5 % of the component's
   depth bytes and together more than half. Depth bytes leave out token tables and
   non-persistent buffers, which do not grow with the number of blocks (a tiny model of a
   large vocabulary keeps most of its bytes in its token table).
   Their order is definition order: a model that runs them otherwise gets each
   out-of-order block loaded synchronously on its first call (``stats.fallback_loads``,
   never a wrong result), and an info log line names the discovered containers.

The table's container names come from the models' source code (diffusers 0.42,
transformers 5): ``WanTransformer3DModel.blocks``; ``FluxTransformer2DModel.
transformer_blocks`` (double-stream) then ``single_transformer_blocks``;
``SD3Transformer2DModel.transformer_blocks``; ``QwenImageTransformer2DModel.
transformer_blocks``; ``T5EncoderModel`` / ``UMT5EncoderModel`` ``encoder.block``;
``CLIPTextModel`` / ``CLIPTextModelWithProjection`` ``encoder.layers`` (transformers 5;
``text_model.encoder.layers`` in transformers 4);
``Qwen2_5_VLForConditionalGeneration`` ``model.language_model.layers`` (the decoder
layers of the language model that Qwen-Image uses as its text encoder; the vision tower
stays resident).

The table also lists the other diffusers 0.42 transformers of the families layer mode is
tested on (HunyuanVideo, HunyuanVideo 1.5, LTX, LTX-2, CogVideoX, Sana, PixArt, Chroma,
Lumina2, HiDream, FLUX.2, Mochi, SkyReels-V2, Kandinsky 5, Z-Image) and the decoder LLMs
used as text encoders (Llama, Gemma, Gemma 2, Qwen3, GLM, Mistral 3), so that where a
forward runs its containers out of definition order (Lumina2: ``context_refiner`` before
``noise_refiner``) the first call's order is right too.

Text encoders need no row: structure alone finds the blocks of every text-encoder class
diffusers 0.42's pipelines name (``tests/test_text_encoder_blocks.py`` walks them:
``Qwen3ForCausalLM``, ``Gemma3ForConditionalGeneration``, ``LlavaForConditionalGeneration``,
``Qwen2_5_VLTextModel``, ``Gemma2ForCausalLM``, ``MultilingualCLIP``, ... and the
``PriorTransformer`` of Kandinsky's priors). The text-encoder rows above say what structure
finds (the same test checks it); they stay because ``models/fit`` plans from weight-file
headers, where only a class name is known.

The order of the blocks is the order of the containers, then of their children: the order
a forward runs them in for every model in the table. A child that is itself an
``nn.ModuleList`` (no forward of its own, so never called) is replaced by its children.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

__all__ = [
    "BUILTIN_BLOCK_ATTRS",
    "PATH_ALTERNATIVES",
    "block_attrs",
    "discover_blocks",
    "discovered_block_attrs",
    "token_embedding_path",
]

logger = logging.getLogger(__name__)

#: class name -> container paths. Where transformers 4 nested a path differently, the
#: other spelling is tried too (``PATH_ALTERNATIVES``).
BUILTIN_BLOCK_ATTRS: dict[str, tuple[str, ...]] = {
    # diffusers DiTs
    "WanTransformer3DModel": ("blocks",),
    "WanVACETransformer3DModel": ("blocks",),
    "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "SD3Transformer2DModel": ("transformer_blocks",),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "HunyuanVideoTransformer3DModel": ("transformer_blocks", "single_transformer_blocks"),
    "HunyuanVideo15Transformer3DModel": ("transformer_blocks",),
    "LTXVideoTransformer3DModel": ("transformer_blocks",),
    "LTX2VideoTransformer3DModel": ("transformer_blocks",),
    "CogVideoXTransformer3DModel": ("transformer_blocks",),
    "SanaTransformer2DModel": ("transformer_blocks",),
    "PixArtTransformer2DModel": ("transformer_blocks",),
    "ChromaTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "Lumina2Transformer2DModel": ("context_refiner", "noise_refiner", "layers"),
    "HiDreamImageTransformer2DModel": ("double_stream_blocks", "single_stream_blocks"),
    "Flux2Transformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "MochiTransformer3DModel": ("transformer_blocks",),
    "SkyReelsV2Transformer3DModel": ("blocks",),
    "Kandinsky5Transformer3DModel": ("text_transformer_blocks", "visual_transformer_blocks"),
    "ZImageTransformer2DModel": ("noise_refiner", "context_refiner", "layers"),
    # runs ``transformer_blocks[0].norm1.emb`` from its own forward, outside the block:
    # streaming that block would race its copy, so it has no streamable blocks
    "DiTTransformer2DModel": (),
    # ``Transformer2DModel``'s ada_norm_single path runs ``transformer_blocks[0].norm1.emb``
    # outside the block, as DiT's does
    "Transformer2DModel": (),
    # the rest of diffusers 0.42's transformers, containers in the order their forward runs
    # them (tests/test_block_discovery.py walks every exported transformer class)
    "AceStepTransformer1DModel": ("layers",),
    "AllegroTransformer3DModel": ("transformer_blocks",),
    "AnyFlowTransformer3DModel": ("blocks",),
    "AnyFlowFARTransformer3DModel": ("blocks",),
    "AuraFlowTransformer2DModel": ("joint_transformer_blocks", "single_transformer_blocks"),
    "BriaTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "BriaFiboTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "BriaFibo2Transformer2DModel": ("noise_refiner", "layers"),
    "ChronoEditTransformer3DModel": ("blocks",),
    "CogView3PlusTransformer2DModel": ("transformer_blocks",),
    "CogView4Transformer2DModel": ("transformer_blocks",),
    "ConsisIDTransformer3DModel": ("transformer_blocks",),
    "CosmosTransformer3DModel": ("transformer_blocks",),
    "DreamLiteTransformer2DModel": ("transformer_blocks",),
    "EasyAnimateTransformer3DModel": ("transformer_blocks",),
    "ErnieImageTransformer2DModel": ("layers",),
    "GlmImageTransformer2DModel": ("transformer_blocks",),
    "HeliosTransformer3DModel": ("blocks",),
    "HunyuanImageTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "HunyuanVideoFramepackTransformer3DModel": ("transformer_blocks", "single_transformer_blocks"),
    "Ideogram4Transformer2DModel": ("layers",),
    "JoyImageEditTransformer3DModel": ("double_blocks",),
    "JoyImageEditPlusTransformer3DModel": ("double_blocks",),
    "Kandinsky6Transformer3DModel": ("video_text_transformer_blocks", "audio_text_transformer_blocks",
                                     "visual_transformer_blocks"),
    "Kandinsky6SRTransformer3DModel": ("visual_transformer_blocks",),
    "Krea2Transformer2DModel": ("transformer_blocks",),
    "LongCatImageTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "MiniMaxH3Transformer3DModel": ("transformer_blocks",),
    "MiniMaxMusic3Transformer1DModel": ("transformer_blocks",),
    "MotifVideoTransformer3DModel": ("transformer_blocks", "single_transformer_blocks"),
    "NucleusMoEImageTransformer2DModel": ("transformer_blocks",),
    "OmniGenTransformer2DModel": ("layers",),
    "OvisImageTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "PRXTransformer2DModel": ("blocks",),
    "QwenImage21Transformer2DModel": ("transformer_blocks",),
    "SanaVideoTransformer3DModel": ("transformer_blocks",),
    "SanaWMTransformer3DModel": ("blocks",),
    "SanaWMLTX2RefinerTransformer3DModel": ("transformer_blocks",),
    "TransformerTemporalModel": ("transformer_blocks",),
    # the face adapter runs between blocks (every inject_face_latents_blocks): not streamed
    "WanAnimateTransformer3DModel": ("blocks",),
    "WanAnimate2Transformer3DModel": ("blocks",),
    # transformers text encoders
    "T5EncoderModel": ("encoder.block",),
    "UMT5EncoderModel": ("encoder.block",),
    "CLIPTextModel": ("encoder.layers",),
    "CLIPTextModelWithProjection": ("encoder.layers",),
    "Qwen2_5_VLForConditionalGeneration": ("model.language_model.layers",),
    "Qwen2_5_VLModel": ("language_model.layers",),
    "LlamaModel": ("layers",),
    "LlamaForCausalLM": ("model.layers",),
    "GemmaModel": ("layers",),
    "Gemma2Model": ("layers",),
    "Qwen3Model": ("layers",),
    "GlmModel": ("layers",),
    "Mistral3ForConditionalGeneration": ("model.language_model.layers",),
}


#: a container path -> its other spelling (transformers 4 vs 5), tried when the first is absent
PATH_ALTERNATIVES: dict[str, str] = {"encoder.layers": "text_model.encoder.layers"}


def block_attrs(module: nn.Module, override: Sequence[str] | None = None) -> tuple[tuple[str, ...], str]:
    """The container paths for ``module`` and where they came from.

    Returns:
        ``(paths, source)`` with ``source`` one of ``"override"``,
        ``"_layerwise_offload_blocks_attrs"``, ``"table"``, ``"discovered"``
        (``discovered_block_attrs``), or ``"none"`` (empty paths).

    Raises:
        TypeError: the override or the class attribute is not a list/tuple of str.
    """
    if override is not None:
        return _paths(override, "layer_blocks"), "override"
    declared = getattr(type(module), "_layerwise_offload_blocks_attrs", None)
    if declared is not None:
        return _paths(declared, f"{type(module).__name__}._layerwise_offload_blocks_attrs"), (
            "_layerwise_offload_blocks_attrs"
        )
    for cls in type(module).__mro__:
        paths = BUILTIN_BLOCK_ATTRS.get(cls.__name__)
        if paths is not None:
            if any(_resolve(module, p) is None for p in paths):
                other = tuple(PATH_ALTERNATIVES.get(p, p) for p in paths)
                if all(_resolve(module, p) is not None for p in other):
                    return other, "table"
            return paths, "table"
    paths = discovered_block_attrs(module)
    return paths, ("discovered" if paths else "none")


def _bytes(module: nn.Module) -> int:
    seen: set[int] = set()
    total = 0
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _depth_bytes(module: nn.Module, vocab: int | None = None) -> int:
    """Bytes of ``module`` that grow with its depth: its parameters and persistent buffers,
    less the tables of its ``nn.Embedding`` s (a token table's size is set by the
    vocabulary, not by the blocks: a tiny model of a 150k-token vocabulary holds most of
    its bytes there), the ``nn.Linear`` s onto a ``vocab`` of that many tokens (an LM
    head) and the non-persistent buffers (attention masks, RoPE caches); each tensor
    counted once."""
    seen: set[int] = set()
    for sub in module.modules():
        if isinstance(sub, nn.Embedding) or (
            vocab is not None and isinstance(sub, nn.Linear) and sub.out_features == vocab
        ):
            seen.update(id(t) for t in sub.parameters(recurse=False))
    total = 0
    for sub in module.modules():
        tensors = [t for t in sub._parameters.values() if t is not None]
        tensors += [
            b for n, b in sub._buffers.items() if b is not None and n not in sub._non_persistent_buffers_set
        ]
        for t in tensors:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


def _repeats_one_class(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` / ``nn.Sequential`` of two or more children of one class, or
    of one child that is itself built of modules (a one-layer model's only block; a lone
    ``nn.Linear`` is a layer of its parent, not a block)."""
    children = list(module.children())
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or not children:
        return False
    if len(children) == 1:
        return next(children[0].children(), None) is not None
    return len({type(c) for c in children}) == 1


def _repeated_containers(module: nn.Module, vocab: int | None = None) -> list[str]:
    """The outermost containers of repeated blocks in ``module`` (definition order), each
    with at least 5 % of its depth bytes (``_depth_bytes``), when together they hold more
    than half of them; else []."""
    total = _depth_bytes(module, vocab)
    found: list[tuple[str, int]] = []

    def walk(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            if _repeats_one_class(child):
                found.append((prefix + name, _depth_bytes(child, vocab)))
            else:
                walk(f"{prefix}{name}.", child)

    walk("", module)
    big = [(path, n) for path, n in found if n * 20 >= total]
    if total and sum(n for _, n in big) * 2 > total:
        return [path for path, _ in big]
    return []


def _outside_containers(module: nn.Module) -> dict[int, str]:
    """id -> dotted path of every submodule of ``module`` that no ``nn.ModuleList`` /
    ``nn.Sequential`` holds (the first path of a shared one)."""
    out: dict[int, str] = {}

    def walk(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                continue
            out.setdefault(id(child), prefix + name)
            walk(f"{prefix}{name}.", child)

    walk("", module)
    return out


def token_embedding_path(module: nn.Module) -> str | None:
    """The dotted path of the table that embeds ``module``'s input tokens, or None.

    That is the module ``get_input_embeddings()`` returns (transformers models, and the
    diffusers text encoders built on them), else the ``nn.Embedding`` with the most rows;
    in both cases one outside every ``nn.ModuleList`` / ``nn.Sequential`` (a table inside a
    block, such as T5's relative attention bias, embeds no tokens)."""
    outside = _outside_containers(module)
    getter = getattr(module, "get_input_embeddings", None)
    if callable(getter):
        try:
            table = getter()
        except Exception:  # transformers raises NotImplementedError where it cannot tell
            table = None
        if isinstance(table, nn.Module) and id(table) in outside:
            return outside[id(table)]
    tables = [m for m in module.modules() if isinstance(m, nn.Embedding) and id(m) in outside]
    if not tables:
        return None
    return outside[id(max(tables, key=lambda m: m.num_embeddings))]


def discovered_block_attrs(module: nn.Module) -> tuple[str, ...]:
    """Block container paths of a ``module`` that no override, class attribute or table
    entry covers, found by its structure alone:

    1. a UNet (``down_blocks`` and ``up_blocks`` containers): ``("down_blocks",
       "mid_block", "up_blocks")`` (``mid_block``, a single block, when present);
    2. a model that embeds tokens (``token_embedding_path``: every transformers text
       encoder, CausalLM and conditional-generation wrappers included): the containers of
       the nearest module above its token table that has any (rule 3 applied there). That
       is the text model's layers: ``model.layers`` under a ``...ForCausalLM``,
       ``model.language_model.layers`` in a vision-language model (whose vision tower
       stays in the trunk, resident), ``encoder.block`` in T5, ``transformer.encoder.layer``
       in Kandinsky's ``MultilingualCLIP``;
    3. otherwise the outermost ``nn.ModuleList`` / ``nn.Sequential`` containers whose
       children repeat one class (or hold one composite block), each with at least 5 % of
       the module's depth bytes and together more than half. Depth bytes leave out token
       tables, LM heads (in rule 2) and non-persistent buffers (``_depth_bytes``).

    Containers are in definition order. Else ``()``."""
    down, up = getattr(module, "down_blocks", None), getattr(module, "up_blocks", None)
    if isinstance(down, nn.ModuleList) and isinstance(up, nn.ModuleList):
        if isinstance(getattr(module, "mid_block", None), nn.Module):
            return ("down_blocks", "mid_block", "up_blocks")
        return ("down_blocks", "up_blocks")
    table = token_embedding_path(module)
    if table is not None:
        tokens = _resolve(module, table)
        vocab = getattr(tokens, "num_embeddings", None)
        parts = table.split(".")[:-1]
        while True:
            prefix = ".".join(parts)
            stack = _resolve(module, prefix) if prefix else module
            paths = _repeated_containers(stack, vocab) if isinstance(stack, nn.Module) else []
            if paths:
                return tuple(f"{prefix}.{p}" if prefix else p for p in paths)
            if not parts:
                return ()
            parts.pop()
    return tuple(_repeated_containers(module))


def _paths(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must be a list of attribute paths (str), got {value!r}")
    for p in value:
        if not isinstance(p, str) or not p or any(not part for part in p.split(".")):
            raise TypeError(f"{what} entries must be dotted attribute paths, got {p!r}")
    return tuple(value)


def _resolve(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _callable_children(path: str, container: nn.Module) -> list[tuple[str, nn.Module]]:
    """``container``'s children as ``(dotted name, module)``, an ``nn.ModuleList`` child
    replaced by its own children (recursively): a ModuleList has no forward, so the
    streamer's hooks on it would never run (StableCascadeUNet's ``down_blocks`` hold one
    ``nn.ModuleList`` of blocks per level)."""
    out: list[tuple[str, nn.Module]] = []
    for child_name, child in container.named_children():
        name = f"{path}.{child_name}"
        if isinstance(child, nn.ModuleList):
            out += _callable_children(name, child)
        else:
            out.append((name, child))
    return out


def discover_blocks(
    module: nn.Module, override: Sequence[str] | None = None, *, component: str = ""
) -> list[tuple[str, nn.Module]]:
    """The streamed blocks of ``module``, in execution order, as ``(dotted name, block)``.

    Args:
        module: a component (a DiT or a text encoder).
        override: container paths that replace the class attribute and the table.
        component: the component's name, for messages.

    Returns:
        e.g. ``[("blocks.0", WanTransformerBlock), ("blocks.1", ...), ...]``; the names are
        relative to ``module``.

    Raises:
        ValueError: no container was found (the message names the paths looked for and
            where they came from), a path does not lead to an ``nn.ModuleList`` /
            ``nn.Sequential`` of modules, or one block appears twice.
        TypeError: a malformed override or class attribute.
    """
    label = component or type(module).__name__
    paths, source = block_attrs(module, override)
    if not paths:
        raise ValueError(
            f"component {label!r} ({type(module).__name__}) has no discoverable blocks for "
            "layer mode: its class declares no _layerwise_offload_blocks_attrs, is not in "
            f"the built-in table ({sorted(BUILTIN_BLOCK_ATTRS)}), and no containers of repeated "
            f"blocks hold most of its bytes (token tables, LM heads and non-persistent buffers "
            f"left out), above its token table or anywhere; pass "
            f"layer_blocks={{{label!r}: ['<container path>']}}, or select it out of layer mode"
        )
    if source == "discovered":
        logger.info(
            "component %r (%s): no block table entry; layer mode streams the discovered "
            "containers %s in definition order (a block run out of that order is loaded "
            "synchronously on the first call: stats.fallback_loads)",
            label, type(module).__name__, list(paths),
        )
    out: list[tuple[str, nn.Module]] = []
    seen: dict[int, str] = {}
    for path in paths:
        container = _resolve(module, path)
        if source == "discovered" and isinstance(container, nn.Module) and not isinstance(
            container, (nn.ModuleList, nn.Sequential)
        ):
            seen[id(container)] = path  # a UNet's mid block: one block
            out.append((path, container))
            continue
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            found = "nothing" if container is None else type(container).__name__
            raise ValueError(
                f"component {label!r} ({type(module).__name__}): block container {path!r} "
                f"(from {source}) is {found}, expected an nn.ModuleList or nn.Sequential of "
                f"blocks; looked for {list(paths)}"
            )
        for name, block in _callable_children(path, container):
            if id(block) in seen:
                raise ValueError(
                    f"component {label!r}: block {name!r} is the same module as "
                    f"{seen[id(block)]!r}; a block can be streamed once only"
                )
            seen[id(block)] = name
            out.append((name, block))
    if not out:
        raise ValueError(
            f"component {label!r} ({type(module).__name__}): the block containers {list(paths)} "
            f"(from {source}) are empty"
        )
    return out


def check_disjoint(found: Mapping[str, list[tuple[str, nn.Module]]]) -> None:
    """Refuse a block claimed by two components, or nested in another block.

    Raises:
        ValueError: naming both claims.
    """
    owner: dict[int, str] = {}
    for comp, blocks in found.items():
        for name, block in blocks:
            key = id(block)
            if key in owner:
                raise ValueError(
                    f"block {comp}.{name} is also claimed as {owner[key]}; a block can be "
                    "streamed by one component only"
                )
            owner[key] = f"{comp}.{name}"
    for comp, blocks in found.items():
        for name, block in blocks:
            for sub_name, sub in block.named_modules():
                if sub is not block and id(sub) in owner:
                    raise ValueError(
                        f"block {owner[id(sub)]} is nested inside block {comp}.{name}; "
                        "blocks must be disjoint"
                    )
