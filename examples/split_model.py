"""A split model: one transformer holding two mutually exclusive parts.

``SplitTransformer`` has a ``reasoner`` (run once per request to turn the condition
into a plan) and a ``generator`` (run at every denoising step). Generic per-module hooks
cannot keep only one of them resident, so ``SplitPipeline`` implements
``SupportsModelCpuOffload`` and uses ``PartSwitcher``: one context manager per part.

Run it::

    PYTHONPATH=src python examples/split_model.py
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from diffusion_offload import ModelLevelOffloadBackend, PartSwitcher

__all__ = ["SplitPipeline", "SplitTransformer"]


class SplitTransformer(nn.Module):
    """Reasoner (B, D) -> plan (B, D), run once; generator (latents, plan) -> update, run per step."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.reasoner = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.generator = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
        self.switcher: PartSwitcher | None = None

    def _part(self, name: str) -> Any:
        return self.switcher.part(name) if self.switcher is not None else nullcontext()

    def reason(self, cond: torch.Tensor) -> torch.Tensor:
        with self._part("reasoner"):
            return self.reasoner(cond)

    def forward(self, latents: torch.Tensor, plan: torch.Tensor) -> torch.Tensor:
        with self._part("generator"):
            return self.generator(latents + plan)


class SplitPipeline:
    """A pipeline whose only DiT is a ``SplitTransformer``; the ``vae`` stays resident.

    Implements ``SupportsModelCpuOffload``: only the executing part is on the device,
    enable and disable are idempotent, the supplied device and pinning are used, and an
    explicit selection other than ``("dit",)`` / ``("dit", "text_encoder")`` is rejected
    before anything changes (it has no text encoder, so ``text_encoder`` alone is
    unsatisfiable).
    """

    def __init__(self, dim: int = 32, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.transformer = SplitTransformer(dim).eval()
        self.vae = nn.Linear(dim, dim).eval()
        self.device = torch.device("cpu")
        self.dim = dim

    def enable_omni_model_cpu_offload(
        self,
        *,
        device: torch.device,
        pin_memory: bool,
        use_hsdp: bool,
        offload_components: tuple[str, ...] | None = None,
    ) -> None:
        if self.transformer.switcher is not None:
            return
        if offload_components is not None and "dit" not in offload_components:
            raise ValueError(
                f"offload_components={list(offload_components)} cannot be honoured: "
                "SplitPipeline has no text encoder; select 'dit'"
            )
        parts = {"reasoner": self.transformer.reasoner, "generator": self.transformer.generator}
        self.transformer.switcher = PartSwitcher(parts, device, pin_memory, use_hsdp)
        self.vae.to(device)
        self.device = torch.device(device)

    def disable_omni_model_cpu_offload(self) -> None:
        self.transformer.switcher = None

    @torch.no_grad()
    def __call__(self, cond: torch.Tensor, steps: int = 4) -> torch.Tensor:
        """Denoise ``steps`` times from zeros given ``cond`` (B, D); returns (B, D) on the host."""
        plan = self.transformer.reason(cond.to(self.device))
        latents = torch.zeros(cond.shape[0], self.dim, device=self.device)
        for _ in range(steps):
            latents = latents + 0.25 * self.transformer(latents, plan)
        return self.vae(latents).cpu()


if __name__ == "__main__":
    from diffusion_offload.testing import fake_accelerator

    device = fake_accelerator.install()
    cond = torch.randn(2, 32)
    reference = SplitPipeline()(cond)
    pipe = SplitPipeline()
    backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, device)
    backend.enable(pipe)
    out = pipe(cond)
    print("max abs diff vs. no offload:", (out - reference).abs().max().item())
    print("part transfers:", pipe.transformer.switcher.stats)
