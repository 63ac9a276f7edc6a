"""Issue 21 item 12: ``docs/testing.md``'s placement test, run as written (its code block
executed, ``build_my_pipeline`` a tiny Flux), so the documented example stays true."""

from __future__ import annotations

import re
from pathlib import Path

from diffusion_offload.testing import tiny_pipelines

DOC = Path(__file__).resolve().parents[1] / "docs" / "testing.md"


def _example(heading: str) -> str:
    section = DOC.read_text().split(f"## {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_placement_example_of_docs_testing_md_passes(fake_device) -> None:
    namespace = {"build_my_pipeline": lambda: tiny_pipelines.build("flux", 0)}
    exec(compile(_example("A placement test for your pipeline"), str(DOC), "exec"), namespace)
    namespace["test_my_pipeline_offload"](fake_device)
