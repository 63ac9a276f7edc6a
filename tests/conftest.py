"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
import torch

from diffusion_offload.testing import tiny_pipelines


@pytest.fixture(scope="session")
def lora_state_dict() -> dict[str, torch.Tensor]:
    """A peft LoRA (r=2, to_q/to_k, random) for tiny Wan2.1's transformer, as a
    ``load_lora_weights`` state dict."""
    pytest.importorskip("peft", reason="LoRA loading needs peft (the `test` extra installs it)")
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    t = tiny_pipelines.build("wan2.1", 0).transformer
    t.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_k"], init_lora_weights=False))
    return {f"transformer.{k}": v.detach().clone() for k, v in get_peft_model_state_dict(t).items()}
