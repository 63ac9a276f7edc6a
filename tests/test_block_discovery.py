"""Layer mode finds blocks without a table (issue 25, item 5).

A UNet streams its down, mid and up blocks; any other model its containers of repeated
blocks that hold most of its bytes; the built-in table still wins; a model that runs its
discovered blocks out of definition order gets the right result through fallback loads.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

from diffusion_offload import LayerwiseOffloadBackend
from diffusion_offload.core.blocks import block_attrs, discover_blocks
from diffusion_offload.core.discovery import SupportsComponentDiscovery
from diffusion_offload.testing import tiny_families
from diffusion_offload.testing.toy import SyntheticDiT

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def test_unet_streams_its_down_mid_and_up_blocks(fake_device):
    reference = tiny_families.run("sd-image-variation", tiny_families.build("sd-image-variation").to(fake_device))
    pipe = tiny_families.build("sd-image-variation")
    assert block_attrs(pipe.unet) == (("down_blocks", "mid_block", "up_blocks"), "discovered")
    backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device)
    backend.enable(pipe)
    names = [b.name for b in backend.streamer.sequences["unet"]]
    assert names == ["down_blocks.0", "down_blocks.1", "mid_block", "up_blocks.0", "up_blocks.1"]
    for _ in range(2):
        out = tiny_families.run("sd-image-variation", pipe)
        assert float((out - reference).abs().max()) == 0.0
    assert backend.audit() == [] and backend.stats.d2h_bytes == 0 and backend.stats.h2d_bytes > 0
    backend.disable()


class _Undeclared(SyntheticDiT):
    """A SyntheticDiT without the class attribute: its ``blocks`` must be discovered."""

    _layerwise_offload_blocks_attrs: ClassVar[list[str] | None] = None


class _Pipe(nn.Module, SupportsComponentDiscovery):
    _dit_modules: ClassVar[list[str]] = ["transformer"]

    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.transformer = _Undeclared(num_blocks=6, **kwargs)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transformer(x)


def test_repeated_containers_discovered_and_out_of_order_runs_are_exact(fake_device):
    pipe = _Pipe(order=(5, 4, 4, 3, 1, 0))  # reversed, one block twice, block 2 unused
    assert block_attrs(pipe.transformer) == (("blocks",), "discovered")
    x = torch.randn(1, 4, pipe.transformer.proj_in.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = pipe.transformer(x)  # on the host: the fake device computes the same
    backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device)
    backend.enable(pipe)
    assert len(backend.streamer.sequences["transformer"]) == 6
    with torch.no_grad():
        first = pipe(x.to(fake_device)).cpu()
        second = pipe(x.to(fake_device)).cpu()
    assert torch.equal(first, reference) and torch.equal(second, reference)
    assert backend.stats.fallback_loads > 0  # the first call's out-of-order blocks, reported
    assert backend.audit() == [] and backend.stats.d2h_bytes == 0


def test_table_wins_and_small_containers_are_not_blocks():
    class Small(nn.Module):  # repeated blocks hold a third of the bytes: no blocks
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(64, 64)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    with pytest.raises(ValueError, match="no discoverable blocks"):
        discover_blocks(Small(), component="small")

    class WanTransformer3DModel(nn.Module):  # a table name: its container, not discovery's
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
            self.other = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    assert block_attrs(WanTransformer3DModel()) == (("blocks",), "table")


class _Staged(nn.Module):
    """Stages of blocks as an ``nn.ModuleList`` of ``nn.ModuleList`` s (StableCascadeUNet's
    ``down_blocks``): the forward calls the inner blocks, never a stage itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stages = nn.ModuleList(nn.ModuleList(nn.Linear(32, 32) for _ in range(3)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            for block in stage:
                x = torch.tanh(block(x))
        return x


class _StagedPipe(_Pipe):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.transformer = _Staged()


def test_a_list_of_lists_streams_its_inner_blocks(fake_device):
    # a ModuleList has no forward: streamed as one block its hooks never ran, and the inner
    # blocks read weights whose host-to-device copy nothing waited for (a fakegpu RaceError)
    pipe = _StagedPipe()
    names = [name for name, _ in discover_blocks(pipe.transformer)]
    assert names == [f"stages.{s}.{b}" for s in range(2) for b in range(3)]
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = pipe.transformer(x)
    backend = LayerwiseOffloadBackend({"mode": "layer", "components": ["dit"]}, fake_device)
    backend.enable(pipe)
    with torch.no_grad():
        out = pipe(x.to(fake_device)).cpu()
    assert torch.equal(out, reference)
    assert backend.audit() == [] and backend.stats.d2h_bytes == 0 and backend.stats.fallback_loads == 0
    backend.disable()


def test_table_streams_hunyuan_video_15_blocks_that_hold_under_half_its_bytes():
    # a 2-layer HunyuanVideo 1.5 DiT: its token refiner and embedders outweigh the double
    # stream blocks, so discovery finds nothing; the table names them
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=16, text_embed_2_dim=32, image_embed_dim=12,
        rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v",
    )
    assert block_attrs(model) == (("transformer_blocks",), "table")
    assert [name for name, _ in discover_blocks(model)] == ["transformer_blocks.0", "transformer_blocks.1"]


#: diffusers transformers left to discovery, and why the table cannot say better
NOT_IN_TABLE = {
    # runs transformer_blocks[i] and temporal_transformer_blocks[i] in turn (zip): no order
    # of whole containers is the order it runs them in
    "LatteTransformer3DModel",
    # its per-mode containers (mode_blocks[<mode>]) are named by its config
    "Flux3Transformer2DModel",
}


def test_the_table_covers_every_diffusers_transformer():
    """Issue 25 item 5: the built-in table covers every transformer class diffusers exports
    (each container path it names is a ModuleList its __init__ creates), except the two
    documented in NOT_IN_TABLE."""
    import inspect

    import diffusers

    from diffusion_offload.core.blocks import BUILTIN_BLOCK_ATTRS

    names = sorted(n for n in dir(diffusers) if n.endswith("Model") and "Transformer" in n)
    assert len(names) > 60
    missing = [n for n in names if n not in BUILTIN_BLOCK_ATTRS and n not in NOT_IN_TABLE]
    assert missing == []
    for n in names:
        for path in BUILTIN_BLOCK_ATTRS.get(n, ()):
            init = inspect.getsource(getattr(diffusers, n).__init__)
            last = path.rsplit(".", 1)[-1]
            assert f"self.{last}" in init or f'f"{{prefix}}_{last.split("_", 1)[1]}"' in init, (n, path)
