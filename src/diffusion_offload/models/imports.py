"""Importing the model libraries without their import-time noise.

With the quantization backends installed, importing diffusers' pipelines imports them too,
and they print at import: torchao reports its CUDA-only extensions it could not load and
its enums registered with torch's pytree (one ``W...`` log line each), bitsandbytes that
its optional ``kernels`` package is missing, diffusers that it could not import torchao's
tensor classes. None of it concerns a run, and it breaks the CLI's rule that an error is
one line. ``import_model_libraries`` imports them once with the process's standard output
and error silenced (``sys.stdout``/``sys.stderr`` and file descriptors 1 and 2, so C-level
prints too), and the ``logging`` module and warnings; later imports of the same modules
are then silent (Python caches them). An import that fails raises as usual.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Iterator

__all__ = ["QUIET_MODULES", "import_model_libraries"]

QUIET_MODULES: tuple[str, ...] = ("bitsandbytes", "torchao", "optimum.quanto", "diffusers.pipelines")
"""The modules ``import_model_libraries`` imports quietly, in order (the optional
quantization backends, where installed, then diffusers' pipelines, which import them)."""

_REQUIRED = "diffusers.pipelines"  # the one whose ImportError is raised, not swallowed


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    previous = logging.root.manager.disable
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        logging.disable(logging.CRITICAL)
        with warnings.catch_warnings(), open(os.devnull, "w") as sink:
            warnings.simplefilter("ignore")
            with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
                yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.disable(previous)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing
        return False


def import_model_libraries() -> None:
    """Import ``QUIET_MODULES`` (those installed) with their import-time output silenced.

    Raises:
        ImportError: diffusers' pipelines cannot be imported (its message, unchanged).
    """
    for name in QUIET_MODULES:
        if name in sys.modules or not _installed(name):
            continue
        with _silenced():
            try:
                importlib.import_module(name)
            except ImportError:
                if name == _REQUIRED:
                    raise
            except Exception:  # noqa: BLE001 - an optional backend broken on this host
                pass  # diffusers then treats it as absent, as it would anyway
