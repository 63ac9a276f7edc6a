"""A toy pipeline that declares its components (``SupportsComponentDiscovery``).

Two DiTs (``transformer``, ``transformer_2``), a text encoder under a dotted path
(``encoders.text``), an image encoder (``encoders.image``) and a VAE, each with
parameters, persistent and non-persistent buffers. ``ToyPipeline.__call__`` runs
encoders, then the DiTs in a given order, then the VAE's ``decode`` under
``offload_component`` (a non-``forward`` entry point), like a diffusers pipeline.
Sizes are tiny; everything is float32 and deterministic given ``seed``.

For layer-wise offload (mode ``"layer"``) the module also has :class:`SyntheticDiT`, a
small transformer-like model with many equal blocks in ``blocks`` (declared through
``_layerwise_offload_blocks_attrs``), whose forward can skip blocks, run a block twice or
follow any block order, so tests can check that a block streamer follows the blocks a
forward really runs rather than assuming ``0, 1, ..., n-1``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from ..core.discovery import SupportsComponentDiscovery
from ..core.hooks import get_hook, offload_component

__all__ = ["SyntheticBlock", "SyntheticDiT", "SyntheticPipeline", "ToyBlock", "ToyPipeline"]


class ToyBlock(nn.Module):
    """Linear -> GELU -> Linear with a persistent ``scale`` and a non-persistent ``shift``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim))
        self.register_buffer("shift", torch.full((dim,), 0.01), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))) * self.scale + self.shift


class ToyDiT(nn.Module):
    """Takes latents (B, D) and a condition (B, D); returns the predicted update (B, D)."""

    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(self, dim: int, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ToyBlock(dim, 2 * dim) for _ in range(depth))

    def forward(self, latents: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = latents + cond
        for block in self.blocks:
            h = h + block(h)
        return h


class ToyEncoder(nn.Module):
    """Embeds token ids (B, T) -> (B, D) by mean pooling."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = ToyBlock(dim, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.embed(ids).mean(dim=1))


class ToyImageEncoder(nn.Module):
    """Projects an image (B, D) -> (B, D)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.block = ToyBlock(dim, dim)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.block(image)


class ToyVAE(nn.Module):
    """``decode`` maps latents (B, D) -> pixels (B, D); not called through ``forward``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.post = nn.Linear(dim, dim)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.post(latents))

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decode(latents)


class ToyPipeline(nn.Module, SupportsComponentDiscovery):
    """The toy pipeline (see module docstring). ``dim`` sets every width."""

    _dit_modules: ClassVar[list[str]] = ["transformer", "transformer_2"]
    _encoder_modules: ClassVar[list[str]] = ["encoders.text", "encoders.image"]
    _vae_modules: ClassVar[list[str]] = ["vae"]
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self, dim: int = 16, vocab: int = 32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.transformer = ToyDiT(dim)
        self.transformer_2 = ToyDiT(dim)
        self.encoders = nn.ModuleDict({"text": ToyEncoder(vocab, dim), "image": ToyImageEncoder(dim)})
        self.vae = ToyVAE(dim)
        self.dim = dim
        self.eval()

    def __call__(  # type: ignore[override]
        self,
        ids: torch.Tensor,
        image: torch.Tensor,
        order: Sequence[str] = ("transformer", "transformer_2"),
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """Run encoders, the DiTs in ``order``, then ``vae.decode``; return (B, D) on the host."""
        with torch.no_grad():
            cond = self.encoders["text"](ids.to(device)) + self.encoders["image"](image.to(device))
            latents = torch.zeros(ids.shape[0], self.dim, device=device)
            for name in order:
                latents = latents + 0.5 * getattr(self, name)(latents, cond)
            if get_hook(self.vae) is not None:
                with offload_component(self.vae):
                    out = self.vae.decode(latents)
            else:
                out = self.vae.decode(latents)
            return out.cpu()


# --------------------------------------------------------------------------- layer mode


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _indices(name: str, value: object, num_blocks: int) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of block indices, got {value!r}")
    out = []
    for i in value:
        if isinstance(i, bool) or not isinstance(i, numbers.Integral):
            raise TypeError(f"{name} must hold block indices (int), got {i!r} in {value!r}")
        if not 0 <= i < num_blocks:
            raise ValueError(
                f"{name}: block index {i!r} out of range; allowed 0 to {num_blocks - 1} "
                f"(num_blocks={num_blocks})"
            )
        out.append(int(i))
    return tuple(out)


class SyntheticBlock(nn.Module):
    """A pre-norm transformer block: ``x + attn(LN(x))`` then ``x + mlp(LN(x))``.

    Attention is written out (``softmax(q k^T / sqrt(d)) v`` over the sequence, per head:
    plain ``matmul``/``softmax``, no fused kernel), so it runs on any device, the test fake
    accelerator included. Besides parameters (two LayerNorms, ``qkv``, ``proj``, ``fc1``,
    ``fc2``) the block holds a persistent buffer ``residual_scale`` (``(width,)``, scales
    the MLP branch) and a non-persistent buffer ``attn_temperature`` (a scalar tensor), so
    a streamer has to move buffers of both kinds too.

    Args:
        width: model width ``W``; a multiple of ``heads``.
        heads: attention heads.
        mlp_ratio: MLP hidden width is ``mlp_ratio * width``.

    Shapes: ``forward(x)`` with ``x`` ``[batch, seq, W]`` returns ``[batch, seq, W]``, in
    ``x``'s dtype (the block's dtype).
    """

    def __init__(self, width: int, heads: int, mlp_ratio: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.fc2 = nn.Linear(mlp_ratio * width, width)
        self.register_buffer("residual_scale", torch.linspace(0.5, 1.0, width))
        self.register_buffer("attn_temperature", torch.tensor(1.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        d = w // self.heads
        qkv = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each [b, heads, s, d]
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        attn = torch.softmax(scores / self.attn_temperature, dim=-1)
        mixed = torch.matmul(attn, v).transpose(1, 2).reshape(b, s, w)
        x = x + self.proj(mixed)
        hidden = torch.nn.functional.gelu(self.fc1(self.norm2(x)))
        return x + self.fc2(hidden) * self.residual_scale


class SyntheticDiT(nn.Module):
    """A small synthetic DiT for layer-wise offload tests: many equal blocks in ``blocks``.

    Layout: ``proj_in`` (Linear ``in_dim -> width``), ``blocks`` (an ``nn.ModuleList`` of
    ``num_blocks`` :class:`SyntheticBlock`), ``norm_out`` (LayerNorm) and ``head`` (Linear
    ``width -> in_dim``). The class declares
    ``_layerwise_offload_blocks_attrs = ["blocks"]``.

    The blocks a forward runs, in order, are :attr:`block_order`: by default
    ``0, 1, ..., num_blocks - 1``; ``skip`` leaves blocks out, ``repeat`` runs a block
    twice in a row (e.g. ``skip=(3,)`` gives ``0, 1, 2, 4, ...``; ``repeat=(2,)`` gives
    ``0, 1, 2, 2, 3, ...``), and ``order`` gives the sequence outright (any indices,
    repeats allowed, e.g. reversed). :attr:`block_order` may also be reassigned later
    (a tuple of valid indices).

    Weights are a pure function of ``(num_blocks, width, in_dim, heads, mlp_ratio, seed)``
    (initialised under a forked CPU RNG, so the caller's global RNG state is untouched;
    ``skip``/``repeat``/``order`` do not change them). With the defaults one block is
    about 33 KiB of float32 (``width=32``, ``mlp_ratio=2``), the whole model ~530 KiB.
    The model is built on the CPU in ``eval()`` mode.

    Args:
        num_blocks: number of blocks, an int >= 1.
        width: model width, an int >= 1 that ``heads`` divides.
        in_dim: feature size of the input and output tokens.
        heads: attention heads.
        mlp_ratio: MLP hidden width is ``mlp_ratio * width``.
        seed: seed of the deterministic initialisation.
        skip: block indices the forward leaves out.
        repeat: block indices the forward runs twice in a row.
        order: the executed block indices outright; exclusive with ``skip``/``repeat``.
        dtype: floating dtype of parameters and buffers (default float32).

    Raises:
        TypeError: a count, index or ``dtype`` of the wrong type.
        ValueError: a count < 1, ``width`` not a multiple of ``heads``, an index out of
            range, a block both skipped and repeated, ``order`` combined with
            ``skip``/``repeat``, or an empty block order.
    """

    _layerwise_offload_blocks_attrs: ClassVar[list[str]] = ["blocks"]

    def __init__(
        self,
        num_blocks: int = 16,
        width: int = 32,
        in_dim: int = 8,
        heads: int = 2,
        mlp_ratio: int = 2,
        seed: int = 0,
        skip: Sequence[int] = (),
        repeat: Sequence[int] = (),
        order: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        num_blocks = _positive_int("num_blocks", num_blocks)
        width = _positive_int("width", width)
        in_dim = _positive_int("in_dim", in_dim)
        heads = _positive_int("heads", heads)
        mlp_ratio = _positive_int("mlp_ratio", mlp_ratio)
        if width % heads:
            raise ValueError(f"width must be a multiple of heads, got width={width}, heads={heads}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        skip_t = _indices("skip", skip, num_blocks)
        repeat_t = _indices("repeat", repeat, num_blocks)
        both = sorted(set(skip_t) & set(repeat_t))
        if both:
            raise ValueError(f"blocks {both} are both in skip and in repeat; choose one")
        if order is not None:
            if skip_t or repeat_t:
                raise ValueError(
                    "order gives the block sequence outright; do not combine it with skip or repeat"
                )
            block_order = _indices("order", order, num_blocks)
        else:
            block_order = tuple(
                j
                for i in range(num_blocks)
                if i not in skip_t
                for j in ((i, i) if i in repeat_t else (i,))
            )
        self.in_dim = in_dim
        self.width = width
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.proj_in = nn.Linear(in_dim, width)
            self.blocks = nn.ModuleList(
                SyntheticBlock(width, heads, mlp_ratio) for _ in range(num_blocks)
            )
            self.norm_out = nn.LayerNorm(width)
            self.head = nn.Linear(width, in_dim)
        self.block_order = block_order
        self.to(dtype)
        self.eval()

    @property
    def block_order(self) -> tuple[int, ...]:
        """The block indices a forward runs, in order (see the class docstring)."""
        return self._block_order

    @block_order.setter
    def block_order(self, value: Sequence[int]) -> None:
        order = _indices("block_order", value, len(self.blocks))
        if not order:
            raise ValueError("block_order is empty; a forward must run at least one block")
        self._block_order = order

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run ``proj_in``, the blocks in :attr:`block_order`, ``norm_out`` and ``head``.

        Args:
            x: ``[batch, seq, in_dim]``, the model's dtype and device.

        Returns:
            ``[batch, seq, in_dim]``, same dtype and device.

        Raises:
            ValueError: ``x`` is not 3-D with last dimension ``in_dim``.
        """
        if x.dim() != 3 or x.shape[-1] != self.in_dim:
            raise ValueError(f"x must be [batch, seq, {self.in_dim}], got {list(x.shape)}")
        h = self.proj_in(x)
        for i in self._block_order:
            h = self.blocks[i](h)
        return self.head(self.norm_out(h))


class SyntheticPipeline(nn.Module, SupportsComponentDiscovery):
    """A DiT-only pipeline around one :class:`SyntheticDiT` (component ``transformer``),
    for layer-mode tests: ``pipe(x)`` is ``pipe.transformer(x)``.

    Args:
        **kwargs: passed to :class:`SyntheticDiT` (``num_blocks``, ``width``, ``skip``...).

    Raises:
        TypeError, ValueError: as :class:`SyntheticDiT`.
    """

    _dit_modules: ClassVar[list[str]] = ["transformer"]
    _encoder_modules: ClassVar[list[str]] = []
    _vae_modules: ClassVar[list[str]] = []
    _resident_modules: ClassVar[list[str]] = []

    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.transformer = SyntheticDiT(**kwargs)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[batch, seq, in_dim]`` on the model's device; returns the same shape."""
        return self.transformer(x)

