"""``quiet_libraries``: with the quantization backends installed (the test extra installs
torchao and bitsandbytes), importing diffusers' pipelines prints nothing, so the CLI's
errors stay one line; and nothing is imported to get there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

CODE = """
import sys
from diffusion_offload.cli_args import quiet_libraries
quiet_libraries()
assert "optimum.quanto" not in sys.modules  # silenced without being imported
from diffusers import DiffusionPipeline  # imports torchao and bitsandbytes where installed
import transformers
print("imported", "torchao" in sys.modules, "bitsandbytes" in sys.modules)
"""


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao (the test extra)")
def test_importing_the_pipelines_prints_nothing_with_the_quantization_backends_installed():
    run = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr
    assert run.stdout == "imported True True\n"
    assert run.stderr == ""
