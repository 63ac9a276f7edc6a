"""The core cases of issue 8 (``tests/cases_core/``, copied from ``../shared/cases/core``),
each run in this process as a test: its last line must be ``RESULT: PASS``.

A case builds its own tiny models, runs on the fake accelerator and prints one line per
check; see each file's docstring for the situation and the expected behaviour.
"""

from __future__ import annotations

import contextlib
import io
import runpy
from pathlib import Path

import pytest

from diffusion_offload.testing.pytest_plugin import requires_fake

CASES = sorted((Path(__file__).parent / "cases_core").glob("[0-9][0-9]_*.py"))


@requires_fake
@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_core_case(case: Path, fake_device) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        runpy.run_path(str(case), run_name="__main__")
    lines = out.getvalue().strip().splitlines()
    assert lines and lines[-1] == "RESULT: PASS", out.getvalue()
    assert done.value.code == 0
