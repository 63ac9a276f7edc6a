"""The tiny families' registry (``tiny_families.build``/``run`` over the plain, image and
video families); the families themselves run in the compatibility matrix
(``tests/test_pipeline_matrix.py``)."""

from __future__ import annotations

import pytest

from diffusion_offload.testing import pipeline_matrix, tiny_families, tiny_image_families, tiny_video_families


@pytest.mark.parametrize("call", [tiny_families.build, lambda name: tiny_families.run(name, None)])
def test_unknown_family_is_named_with_the_allowed_ones(call):
    with pytest.raises(ValueError, match=r"family='wan9' is not a tiny family; allowed: \['animatediff'"):
        call("wan9")


def test_every_image_and_video_family_is_in_the_matrix():
    assert set(tiny_video_families.FAMILIES) <= set(pipeline_matrix.FAMILIES)
    assert set(tiny_image_families.FAMILIES) <= set(pipeline_matrix.FAMILIES)
