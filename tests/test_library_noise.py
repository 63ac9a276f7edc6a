"""Library noise and the device memory it keeps (issue 38 item 6).

* Every CLI command prints nothing of the libraries' (the ``kernels`` and
  ``bitsandbytes`` loggers included, which bitsandbytes 0.50 with ``kernels`` >= 0.19
  triggers at import, offline): ``--help``, ``make-tiny`` and a ``generate`` print only
  our own lines, a bad ``--height`` and ``serve`` on a port in use one error line.
* This package imports no quantization library (bitsandbytes, torchao, optimum-quanto,
  kernels) itself: those a tiny ``generate`` brings in are imported by diffusers and
  transformers at their own import.
* ``Omni.close()`` frees all device memory with a handler that keeps records installed:
  a library's warning carrying an exception (bitsandbytes logs the exception of its
  failed kernel download) keeps no frames (``detach_library_tracebacks``).
"""

from __future__ import annotations

import gc
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffusion_offload.engine import Omni, SamplingParams
from diffusion_offload.engine.omni import detach_library_tracebacks
from diffusion_offload.testing import fake_accelerator as fa
from diffusion_offload.testing import tiny_pipelines

CLI = [sys.executable, "-m", "diffusion_offload"]
FULL = {"mode": "module", "components": ["dit", "text_encoder"]}
_BAR = re.compile(r"\s*\d+%\|[^\r\n]*?\| \d+/\d+ \[[^\]\r\n]*\]")


def _env(tmp: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "DIFFUSION_OFFLOAD_CACHE": str(tmp / "cache"),
            "PYTHONWARNINGS": "default"}  # Python warnings shown unless we silence them


def _lines(stderr: str) -> list[str]:
    """``stderr``'s lines without the denoising progress bar (tqdm's ``\\r`` updates), the
    one bar the CLI keeps on purpose."""
    return [line for line in _BAR.sub("", stderr.replace("\r", "")).split("\n") if line.strip()]


@pytest.fixture(scope="module")
def wan22(tmp_path_factory) -> Path:
    """Tiny Wan2.2 saved in diffusers format."""
    return tiny_pipelines.save("wan2.2", tmp_path_factory.mktemp("w22") / "model")


def _cli(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """One CLI command in its own process (about 6 s: torch and diffusers are imported)."""
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=_env(tmp))


def test_help_prints_nothing_on_stderr(tmp_path):
    run = _cli(tmp_path, "--help")
    assert run.returncode == 0 and run.stdout.startswith("usage: diffusion-offload")
    assert run.stderr == ""


def test_make_tiny_prints_only_the_folder(tmp_path):
    run = _cli(tmp_path, "make-tiny", "wan2.2", str(tmp_path / "made"))
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert run.stdout == f"{tmp_path / 'made'}\n"


def test_generate_with_the_embedded_model_prints_only_its_own_lines(tmp_path):
    """Our two lines, the denoising bar and the metrics table (stdout is not a terminal)."""
    run = _cli(tmp_path, "generate", "--output", str(tmp_path / "out.mp4"))
    assert run.returncode == 0, run.stderr
    lines = _lines(run.stderr)
    assert lines[:2] == [
        f"building the embedded tiny Wan2.2 model in {tmp_path / 'cache' / 'tiny-wan2.2'} ...",
        "no accelerator found: running on the CPU",
    ]
    assert lines[2].strip() == "diffusion-offload"  # the table's title, centred on its width
    assert [line[0] for line in lines[3:]] == list("┏┃┡") + ["│"] * 12 + ["└"]
    assert lines[-2].split("│")[1].strip() == "output"  # its value cut to the 80 columns
    assert (tmp_path / "out.mp4").stat().st_size > 0


def test_a_bad_height_is_one_error_line(tmp_path, wan22):
    run = _cli(tmp_path, "generate", "--model", str(wan22), "--height", "33", "--output", str(tmp_path / "bad.mp4"))
    assert run.returncode == 2
    assert run.stderr == (
        "diffusion-offload: error: --height 33 is not allowed by WanPipeline: it must be a multiple "
        "of 16 (its VAE scale factor times its patch size), e.g. 32 or 48\n"
    )
    assert run.stdout == ""
    assert not (tmp_path / "bad.mp4").exists()


def test_serve_on_a_port_in_use_is_one_error_line(tmp_path, wan22):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        run = _cli(tmp_path, "serve", str(wan22), "--device", "cpu", "--port", str(port))
    assert run.returncode == 2
    assert run.stderr == (
        f"diffusion-offload: error: --port {port}: address 127.0.0.1:{port} is already in use "
        "(another server?); choose another --port, or --port 0 for a free one\n"
    )


# ----------------------------------------------------------------------------- lazy imports

QUANT = ("bitsandbytes", "torchao", "optimum.quanto", "kernels")

_IMPORTERS = """
import importlib.abc, importlib.machinery, json, sys, traceback
WATCH = %r
found = {}
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in WATCH:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run = spec.loader.exec_module
        def exec_module(module, name=name):
            frames = [f for f in traceback.extract_stack()[:-1] if "importlib" not in f.filename]
            found[name] = frames[-1].filename  # the file whose import statement ran it
            return run(module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Finder())
import diffusion_offload
from diffusion_offload import LayerwiseOffloadBackend, ModelLevelOffloadBackend
import diffusion_offload.core.quantized, diffusion_offload.engine
after_import = sorted(m for m in WATCH if m in sys.modules)
from diffusion_offload import cli
rc = cli.main(["generate", "--model", sys.argv[1], "--output", sys.argv[2]])
print(json.dumps({"rc": rc, "after_import": after_import, "importers": found,
                  "package": diffusion_offload.__path__[0]}))
"""


def test_quantization_libraries_are_not_imported_by_this_package(tmp_path):
    """Importing the package and its engine imports none of them; a tiny default
    ``generate`` imports those diffusers and transformers import at their own import
    (none of this package's files runs the import)."""
    model = tiny_pipelines.save("wan2.2", tmp_path / "wan")
    code = _IMPORTERS % (QUANT,)
    run = subprocess.run([sys.executable, "-c", code, str(model), str(tmp_path / "o.mp4")],
                         capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    assert run.returncode == 0, run.stderr
    import json

    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["rc"] in (0, None)
    assert result["after_import"] == []
    package = result["package"]
    importers = result["importers"]
    assert all(not f.startswith(package) for f in importers.values()), importers
    assert "optimum.quanto" not in importers
    libraries = {name: Path(f).parts[-3:] for name, f in importers.items()}
    for name, parts in libraries.items():
        assert "site-packages" in Path(importers[name]).parts, (name, importers[name])
        assert parts[0] in ("diffusers", "transformers", "integrations", "quantizers", "bitsandbytes"), (name, parts)


# ----------------------------------------------------------------------------- close() frees


def _params() -> SamplingParams:
    keys = ("height", "width", "num_frames", "num_inference_steps")
    return SamplingParams(**{k: v for k, v in tiny_pipelines.default_call_kwargs("wan2.2").items() if k in keys})


def _warn_like_bitsandbytes(how: str):
    """A forward hook that logs on a library's logger as bitsandbytes does at import (the
    exception as an argument), or with ``exc_info``: the exception's traceback holds the
    hook's frame, whose callers hold the pipeline's call and the engine."""
    pending = [1]

    def hook(module, args, output):
        if not pending:
            return
        pending.pop()
        try:
            raise ValueError("Version 1 of 'kernels-community/x' is not available in the local cache")
        except ValueError as exc:
            log = logging.getLogger("bitsandbytes.backends.cpu.ops")
            if how == "args":
                log.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s", exc)
            else:
                log.warning("Failed to load CPU gemm_4bit_forward", exc_info=True)
    return hook


@pytest.mark.parametrize("how", ["args", "exc_info"])
def test_close_frees_the_device_with_pytest_capturing_a_library_warning(how, wan22, fake_device, caplog):
    caplog.set_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops")  # whatever quieted it
    gc.collect()
    before = fa.stats()["allocated_bytes"]
    engine = Omni(wan22, FULL, device="fakegpu", progress=False)
    engine.pipeline.transformer.register_forward_hook(_warn_like_bitsandbytes(how))
    engine.generate("a cat", _params())
    engine.close()
    gc.collect()
    (record,) = [r for r in caplog.records if r.name == "bitsandbytes.backends.cpu.ops"]
    assert fa.stats()["allocated_bytes"] == before
    # the record reads as it did
    if how == "args":
        assert record.getMessage() == ("Failed to load CPU gemm_4bit_forward from kernels-community: "
                                       "Version 1 of 'kernels-community/x' is not available in the local cache")
        assert repr(record.args[0]) == ("ValueError(\"Version 1 of 'kernels-community/x' is not available in "
                                        "the local cache\")")
    else:
        assert record.exc_info is None
        text = logging.Formatter().format(record)
        assert text.startswith("Failed to load CPU gemm_4bit_forward\nTraceback (most recent call last):\n")
        assert text.endswith("ValueError: Version 1 of 'kernels-community/x' is not available in the local cache")


def test_records_of_other_loggers_are_left_as_they_are(caplog):
    detach_library_tracebacks()
    detach_library_tracebacks()  # idempotent: one wrapper
    caplog.set_level(logging.WARNING)
    try:
        raise KeyError("k")
    except KeyError as exc:
        logging.getLogger("my_app").warning("failed: %s", exc, exc_info=True)
        error = exc
    (record,) = caplog.records
    assert record.args == (error,) and record.exc_info[1] is error
    assert logging.getLogRecordFactory()._diffusion_offload_detach is True


_KEEPER = """
import gc, logging, logging.handlers, sys
keeper = logging.handlers.MemoryHandler(capacity=10**9, flushLevel=logging.CRITICAL + 1)
logging.getLogger().addHandler(keeper)  # keeps every WARNING record, formats nothing
from diffusion_offload.testing import fake_accelerator as fa
fa.install()
from diffusion_offload.engine import Omni, SamplingParams
gc.collect()
before = fa.stats()["allocated_bytes"]
with Omni(sys.argv[1], {"mode": "module", "components": ["dit", "text_encoder"]}, device="fakegpu",
          progress=False) as engine:  # diffusers, hence bitsandbytes, imported in here
    engine.generate("a cat", SamplingParams(height=32, width=32, num_frames=5, num_inference_steps=2))
gc.collect()
print(fa.stats()["allocated_bytes"] - before, sorted({r.name for r in keeper.buffer}))
"""


def test_close_frees_the_device_with_a_memory_handler_and_the_real_libraries(wan22, tmp_path):
    """The libraries imported for the first time while ``Omni`` loads the pipeline (a
    fresh process), every WARNING record kept by a ``MemoryHandler``: ``close()`` gives
    every device byte back."""
    run = subprocess.run([sys.executable, "-c", _KEEPER, str(wan22)], capture_output=True, text=True,
                         timeout=120, env=_env(tmp_path))
    assert run.returncode == 0, run.stderr
    left, names = run.stdout.strip().split(" ", 1)
    assert left == "0", names
    if "bitsandbytes.backends.cpu.ops" not in names:  # hosts without AVX512-BF16 ask no kernel
        pytest.skip(f"bitsandbytes logged nothing here ({names}): the kept frames are not exercised")
