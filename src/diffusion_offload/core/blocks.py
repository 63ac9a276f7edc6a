"""Block discovery for layer mode: which submodules of a component are streamed blocks.

A component's blocks are the children, in order, of its block containers (``nn.ModuleList``
or ``nn.Sequential``). The containers are found, in this order of precedence:

1. an override passed by the caller (``layer_blocks={"transformer": ["blocks"]}``);
2. the class attribute ``_layerwise_offload_blocks_attrs: ClassVar[list[str]]`` declared
   by the component's class (dotted paths allowed);
3. the built-in table ``BUILTIN_BLOCK_ATTRS`` below, matched by class name along the MRO,
   so subclasses match too.

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

The order of the blocks is the order of the containers, then of their children: the order
a forward runs them in for every model in the table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

__all__ = ["BUILTIN_BLOCK_ATTRS", "PATH_ALTERNATIVES", "block_attrs", "discover_blocks"]

#: class name -> container paths. Where transformers 4 nested a path differently, the
#: other spelling is tried too (``PATH_ALTERNATIVES``).
BUILTIN_BLOCK_ATTRS: dict[str, tuple[str, ...]] = {
    # diffusers DiTs
    "WanTransformer3DModel": ("blocks",),
    "WanVACETransformer3DModel": ("blocks",),
    "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "SD3Transformer2DModel": ("transformer_blocks",),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    # transformers text encoders
    "T5EncoderModel": ("encoder.block",),
    "UMT5EncoderModel": ("encoder.block",),
    "CLIPTextModel": ("encoder.layers",),
    "CLIPTextModelWithProjection": ("encoder.layers",),
    "Qwen2_5_VLForConditionalGeneration": ("model.language_model.layers",),
    "Qwen2_5_VLModel": ("language_model.layers",),
}


#: a container path -> its other spelling (transformers 4 vs 5), tried when the first is absent
PATH_ALTERNATIVES: dict[str, str] = {"encoder.layers": "text_model.encoder.layers"}


def block_attrs(module: nn.Module, override: Sequence[str] | None = None) -> tuple[tuple[str, ...], str]:
    """The container paths for ``module`` and where they came from.

    Returns:
        ``(paths, source)`` with ``source`` one of ``"override"``,
        ``"_layerwise_offload_blocks_attrs"``, ``"table"``, or ``"none"`` (empty paths).

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
    return (), "none"


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
            "layer mode: its class declares no _layerwise_offload_blocks_attrs and is not in "
            f"the built-in table ({sorted(BUILTIN_BLOCK_ATTRS)}); pass "
            f"layer_blocks={{{label!r}: ['<container path>']}}, or select it out of layer mode"
        )
    out: list[tuple[str, nn.Module]] = []
    seen: dict[int, str] = {}
    for path in paths:
        container = _resolve(module, path)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            found = "nothing" if container is None else type(container).__name__
            raise ValueError(
                f"component {label!r} ({type(module).__name__}): block container {path!r} "
                f"(from {source}) is {found}, expected an nn.ModuleList or nn.Sequential of "
                f"blocks; looked for {list(paths)}"
            )
        for idx, (child_name, block) in enumerate(container.named_children()):
            name = f"{path}.{child_name}"
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
