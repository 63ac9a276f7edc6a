"""Opt-in pytest plugin: a ``fake_device`` fixture on the fake accelerator.

Enable it with ``-p diffusion_offload.testing.pytest_plugin`` (command line or
``addopts``) or ``pytest_plugins = ["diffusion_offload.testing.pytest_plugin"]`` in a
``conftest.py``. It is not auto-loaded.

``fake_device`` installs the fake accelerator once per process, resets its counters and
capacity before each test, and yields ``torch.device("fakegpu:0")``. Set the environment
variable ``DIFFUSION_OFFLOAD_TEST_DEVICE=cuda`` to run the same tests on a real GPU
(``bench/gpu_check.py`` does this); the fixture then yields ``cuda:0``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


#: the device type the ``fake_device`` fixture yields (``fakegpu`` unless the env var says otherwise)
TEST_DEVICE_TYPE: str = os.environ.get("DIFFUSION_OFFLOAD_TEST_DEVICE", "fakegpu").split(":")[0]

#: marks a test that needs the fake accelerator's exact counters or capacity
requires_fake = pytest.mark.skipif(
    TEST_DEVICE_TYPE != "fakegpu",
    reason="needs the fake accelerator's exact byte counters / capacity, which a real device lacks",
)


@pytest.fixture
def fake_device() -> Iterator[torch.device]:
    """The device under test: ``fakegpu:0`` (default) or the one named by the env var."""
    wanted = os.environ.get("DIFFUSION_OFFLOAD_TEST_DEVICE", "fakegpu")
    if wanted != "fakegpu":
        from diffusion_offload.core.platform import normalize_device

        yield normalize_device(wanted)
        return
    from diffusion_offload.testing import fake_accelerator

    device = fake_accelerator.install()
    fake_accelerator.set_capacity(None)
    fake_accelerator.reset_stats()
    yield device
    fake_accelerator.set_capacity(None)
