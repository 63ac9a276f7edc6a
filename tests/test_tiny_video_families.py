"""The tiny video families' interface (``diffusion_offload.testing.tiny_video_families``);
the families themselves run in the compatibility matrix (``tests/test_pipeline_matrix.py``)."""

from __future__ import annotations

import pytest

from diffusion_offload.testing import pipeline_matrix, tiny_video_families


@pytest.mark.parametrize("call", [tiny_video_families.build, lambda name: tiny_video_families.run(name, None)])
def test_unknown_family_is_named_with_the_allowed_ones(call):
    with pytest.raises(ValueError, match=r"family='wan9' is not a tiny video family; allowed: \['animatediff'"):
        call("wan9")


def test_every_video_family_is_in_the_matrix():
    assert set(tiny_video_families.FAMILIES) <= set(pipeline_matrix.FAMILIES)
