"""The layout shows the architecture (issue 22), checked by walking ``src/`` with ``ast``.

* No import circle anywhere in the package, counting imports inside functions (those
  keep ``--help`` torch-free, but they still tie modules together).
* No module imports a private name (``_x``) from another package.
* No module over 800 lines unless it is on ``ALLOWED_LONG``, each with its reason.
* The core (``diffusion_offload.core``) imports nothing above it: not the engine, the
  planner, the server, the CLI or ``testing``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

# Issue 22 (the layout) is not done yet: these checks say exactly what is left. Strict:
# each one that starts to pass fails the suite until its marker is removed.
pytestmark = pytest.mark.xfail(strict=True, reason="issue 22: the layout is not done yet")

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "diffusion_offload"

#: files allowed over 800 lines, each with its reason (none today)
ALLOWED_LONG: dict[str, str] = {}

#: what the core may not import
ABOVE_CORE = ("engine", "planner", "server", "cli", "cli_args", "testing")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """``(imported module, imported name or None, line)`` of every import in the file,
    at any depth (functions included); names resolved to submodules where they are one."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.append((sub, None, node.lineno))
                else:
                    out.append((target, alias.name, node.lineno))
    return [(m, n, line) for m, n, line in out if m == PACKAGE or m.startswith(PACKAGE + ".")]


def _graph() -> dict[str, set[str]]:
    known = _modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        for target, _, _ in _imports(module, path, known):
            # importing a.b.c runs a and a.b first; a package's __init__ is not a
            # dependency of its own submodules' logic, so count the module itself only
            if target in known and target != module:
                graph[module].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_of(module: str, known: dict[str, Path]) -> str:
    path = known[module]
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def test_no_import_circle_counting_imports_inside_functions():
    graph = _graph()
    # a package's __init__ re-exporting its submodules is not a circle through them
    for module in graph:
        graph[module] = {t for t in graph[module] if not module.startswith(t + ".")}
    assert _cycles(graph) == []


def test_no_module_imports_a_private_name_from_another_package():
    known = _modules()
    bad = []
    for module, path in known.items():
        here = _package_of(module, known)
        for target, name, line in _imports(module, path, known):
            private_name = name is not None and name.startswith("_") and not name.startswith("__")
            private_module = target.rpartition(".")[2].startswith("_") and target not in (PACKAGE,)
            if not (private_name or private_module):
                continue
            there = _package_of(target, known) if target in known else target.rpartition(".")[0]
            if there != here:
                bad.append(f"{path.relative_to(SRC)}:{line}: {target}{'.' + name if name else ''}")
    assert bad == []


def test_no_module_over_800_lines_unless_allowed_with_a_reason():
    long = {
        str(path.relative_to(SRC)): n
        for path in (SRC / PACKAGE).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 800
    }
    assert set(long) <= set(ALLOWED_LONG), long
    assert all(reason.strip() for reason in ALLOWED_LONG.values())


def test_the_core_imports_nothing_above_it():
    known = _modules()
    core = f"{PACKAGE}.core"
    assert core in known, "the core subpackage exists"
    bad = []
    for module, path in known.items():
        if module != core and not module.startswith(core + "."):
            continue
        for target, _, line in _imports(module, path, known):
            top = target.split(".")[1] if target.count(".") else ""
            if top in ABOVE_CORE:
                bad.append(f"{path.relative_to(SRC)}:{line}: imports {target}")
    assert bad == []
