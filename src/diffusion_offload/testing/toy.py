"""A toy pipeline that declares its components (``SupportsComponentDiscovery``).

Two DiTs (``transformer``, ``transformer_2``), a text encoder under a dotted path
(``encoders.text``), an image encoder (``encoders.image``) and a VAE, each with
parameters, persistent and non-persistent buffers. ``ToyPipeline.__call__`` runs
encoders, then the DiTs in a given order, then the VAE's ``decode`` under
``offload_component`` (a non-``forward`` entry point), like a diffusers pipeline.
Sizes are tiny; everything is float32 and deterministic given ``seed``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import nn

from ..discovery import SupportsComponentDiscovery
from ..hooks import get_hook, offload_component

__all__ = ["ToyBlock", "ToyPipeline"]


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
