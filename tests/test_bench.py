"""The benchmarks keep working: ``bench/gpu_check.py --tiny`` runs end to end on the fake
device, and every ``diffusion_offload`` name a bench script or example imports exists."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "bench").glob("*.py")) + sorted((ROOT / "examples").glob("*.py"))


def test_gpu_check_tiny_runs_and_its_outputs_match() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--tiny", "--repeats", "1"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| layer,")]
    assert len(rows) == 10, done.stdout  # 5 setups x 2 token counts
    assert all(row.rstrip(" |").endswith("bitwise equal") for row in rows), done.stdout
    assert "races detected 0," in done.stdout


def _imports(path: Path) -> list[tuple[str, str | None]]:
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "diffusion_offload":
            found += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "diffusion_offload"]
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_name_a_script_imports_exists(script: Path) -> None:
    imports = _imports(script)
    assert imports, f"{script.name} imports nothing from diffusion_offload"
    for module, name in imports:
        mod = importlib.import_module(module)
        if name is not None and not hasattr(mod, name):
            importlib.import_module(f"{module}.{name}")  # a submodule: raises if missing
