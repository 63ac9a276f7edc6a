"""The compatibility matrix (issue 25): every family of
``diffusion_offload.testing.pipeline_matrix`` under module mode, the legacy switch, layer
mode and a budget of half its weight bytes, on the fake device: output bit-equal to the
all-resident run, ``audit() == []``, 0 weight bytes D2H during the request, every selected
component moved. A family that cannot run a mode is a documented refusal asserted here.
``tests/pipeline_matrix_table.py`` prints the README's table from the same lists.
"""

from __future__ import annotations

import gc

import pytest

from diffusion_offload.testing import fake_accelerator
from diffusion_offload.testing.pipeline_matrix import FAMILIES, MODES, check, reference
from diffusion_offload.testing.pytest_plugin import requires_fake

pytestmark = [requires_fake, pytest.mark.slow, pytest.mark.filterwarnings("ignore")]

#: (family, mode) -> a phrase of the refusal enable() raises
REFUSED = {
    # DiTTransformer2DModel runs transformer_blocks[0].norm1.emb outside the block
    ("dit", "layer"): "has no discoverable blocks",
}

_REFS: dict[str, object] = {}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("mode", list(MODES))
def test_matrix_cell(fake_device, family, mode):
    # nothing stays on the device once a cell's pipeline is dropped (Qwen-Image's RoPE
    # caches device copies of its frequencies per (module, device) until they are cleared)
    gc.collect()
    assert fake_accelerator.stats()["allocated_bytes"] == 0, "an earlier test left device memory"
    if family not in _REFS:
        _REFS[family] = reference(family, fake_device)
    cell = check(family, mode, fake_device, _REFS[family])
    if (family, mode) in REFUSED:
        assert cell.refused is not None and REFUSED[(family, mode)] in cell.refused
        return
    assert cell.refused is None
    assert cell.max_abs_diff == 0.0
    assert cell.audit == []
    assert cell.weight_d2h_bytes == 0
    assert cell.selected and cell.not_moved == []


def test_animatediff_without_its_motion_adapter_is_exact_and_moves_less(fake_device):
    """The README's advice: AnimateDiff never calls motion_adapter, so dropping it after
    loading changes nothing in the output and takes its bytes out of every DiT-group load."""
    import numpy as np

    from diffusion_offload import ModelLevelOffloadBackend
    from diffusion_offload.testing import tiny_families

    if "animatediff" not in _REFS:
        _REFS["animatediff"] = reference("animatediff", fake_device)
    h2d = {}
    for drop in (False, True):
        pipe = tiny_families.build("animatediff")
        adapter = pipe.motion_adapter
        adapter_bytes = sum(t.numel() * t.element_size() for t in [*adapter.parameters(), *adapter.buffers()])
        if drop:
            pipe.motion_adapter = None
        backend = ModelLevelOffloadBackend({"mode": "module", "components": ["dit"]}, fake_device)
        backend.enable(pipe.to(fake_device))
        try:
            out = tiny_families.run("animatediff", pipe).numpy()
            assert float(np.abs(out - _REFS["animatediff"]).max()) == 0.0
            assert backend.audit() == []
            h2d[drop] = backend.stats.h2d_bytes
        finally:
            backend.disable()
    assert adapter_bytes > 0 and h2d[False] - h2d[True] == adapter_bytes
