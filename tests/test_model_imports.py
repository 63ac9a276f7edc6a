"""``models.imports``: the model libraries' import-time noise is silenced (the CLI's errors
stay one line with torchao and bitsandbytes installed), a failing optional backend is
treated as absent, and a failing diffusers import still raises."""

from __future__ import annotations

import logging
import sys

import pytest

from diffusion_offload.models import imports

NOISY = """
import logging, os, sys, warnings
os.write(2, b"C-level noise on fd 2\\n")
os.write(1, b"C-level noise on fd 1\\n")
print("python noise", file=sys.stderr)
logging.getLogger("noisy").warning("a logged warning")
warnings.warn("a warning")
VALUE = 42
"""


@pytest.fixture
def modules(tmp_path, monkeypatch):
    (tmp_path / "noisy_backend.py").write_text(NOISY)
    (tmp_path / "broken_backend.py").write_text("raise RuntimeError('no CUDA here')\n")
    (tmp_path / "broken_pipelines.py").write_text("raise ImportError('diffusers is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("noisy_backend", "broken_backend", "broken_pipelines"):
        sys.modules.pop(name, None)


def test_import_time_output_is_silenced_and_the_module_is_imported(modules, monkeypatch, capfd, caplog):
    monkeypatch.setattr(imports, "QUIET_MODULES", ("noisy_backend", "not_installed_backend"))
    with caplog.at_level(logging.INFO):
        imports.import_model_libraries()
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert caplog.records == []
    assert sys.modules["noisy_backend"].VALUE == 42
    assert "not_installed_backend" not in sys.modules
    # output works again afterwards, on both file descriptors
    print("after")
    logging.getLogger("noisy").warning("logged after")
    out, err = capfd.readouterr()
    assert out == "after\n"
    assert [r.getMessage() for r in caplog.records] == ["logged after"]


def test_a_broken_optional_backend_is_absent_and_diffusers_failing_raises(modules, monkeypatch, capfd):
    monkeypatch.setattr(imports, "QUIET_MODULES", ("broken_backend",))
    imports.import_model_libraries()
    assert "broken_backend" not in sys.modules
    monkeypatch.setattr(imports, "QUIET_MODULES", ("broken_pipelines",))
    monkeypatch.setattr(imports, "_REQUIRED", "broken_pipelines")
    with pytest.raises(ImportError, match="diffusers is broken"):
        imports.import_model_libraries()
    assert capfd.readouterr() == ("", "")
