"""The layout of ``src/``: imports flow one way, no private name crosses a package, no file
over 800 lines holds several jobs (docs/architecture.md).

Every ``import`` and ``from ... import`` in every module is read with ``ast``, including
those inside functions and ``if TYPE_CHECKING:`` blocks (an import inside a function keeps
``--help`` torch-free but is still a dependency). A name imported from a package whose
``__init__`` re-exports it lazily (a ``_LAZY = {name: submodule}`` table, see
``diffusion_offload.lazy``) counts as an import of the submodule that defines it, and the
package itself depends on every submodule in its table.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "diffusion_offload"

#: files allowed over MAX_LINES, each with the reason it is still one job
MAX_LINES = 800
LONG_FILES: dict[str, str] = {}

#: the packages, bottom to top: a module may import its own layer and the layers below it.
#: The root package ``diffusion_offload`` (a lazy facade over all of them) is left out.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("config", "hooks", "hostmem"),  # core modules at their paths from before the core package
    ("testing",),
    ("lazy", "units"),
    ("models",),
    ("planner",),
    ("engine",),
    ("cli_args",),
    ("server",),
    ("cli", "__main__"),
)

#: the core's modules, bottom to top: each imports only modules before it (core/__init__.py)
CORE_ORDER: tuple[str, ...] = (
    "config", "platform", "caches", "hostmem", "checksum", "writes", "quantized", "arena", "stats", "transfer",
    "readahead", "staging", "tiers", "disktier",
    "weights_from", "checks",
    "residency", "policy", "discovery", "foreign",
    "blocks", "hooks", "streamer", "backends",
)


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    lines: int
    imports: list[tuple[str, str | None, int]] = field(default_factory=list)  # (module, name, line)
    lazy: dict[str, str] = field(default_factory=dict)  # public name -> defining module

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def _resolve(module: Module, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    base = module.package.split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _lazy_table(module: Module, tree: ast.Module) -> dict[str, str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            table = ast.literal_eval(node.value)
            return {name: _resolve(module, len(rel) - len(rel.lstrip(".")), rel.lstrip("."))
                    for name, rel in table.items()}
    return {}


def read_modules(src: Path = SRC) -> dict[str, Module]:
    """Every module under ``src/ROOT``, with its imports (of modules under ``ROOT``)."""
    modules: dict[str, Module] = {}
    trees = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        text = path.read_text()
        modules[name] = Module(name, path, is_package, text.count("\n"))
        trees[name] = ast.parse(text, filename=str(path))
    for name, tree in trees.items():
        module = modules[name]
        module.lazy = _lazy_table(module, tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                module.imports += [(a.name, None, node.lineno) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, node.level, node.module)
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in modules or sub in trees:
                        module.imports.append((sub, None, node.lineno))
                    else:
                        module.imports.append((target, alias.name, node.lineno))
    return modules


def edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    """module -> the modules under ``ROOT`` it imports (lazy re-exports resolved)."""
    out: dict[str, set[str]] = {name: set(m.lazy.values()) & set(modules) for name, m in modules.items()}
    for name, module in modules.items():
        for target, imported, _ in module.imports:
            if target not in modules:
                continue
            defining = modules[target].lazy.get(imported) if imported else None
            out[name].add(defining if defining in modules else target)
        out[name].discard(name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def unresolved(modules: dict[str, Module]) -> list[str]:
    """``module:line`` for each import of a ``ROOT`` module that does not exist (a relative
    import left pointing at a file's old place)."""
    found = []
    for name, module in modules.items():
        for target, _, line in module.imports:
            if (target == ROOT or target.startswith(ROOT + ".")) and target not in modules:
                found.append(f"{name}:{line} imports {target}, which does not exist")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(modules: dict[str, Module]) -> list[str]:
    """``module:line imports name from other`` for each private name (a ``_name``, or a
    module whose own name is private) imported from another package."""
    found = []
    for name, module in modules.items():
        for target, imported, line in module.imports:
            if target not in modules:
                continue
            other = modules[target]
            if other.package == module.package:
                continue
            what = imported if imported and _private(imported) else None
            if what is None and _private(target.rpartition(".")[2]):
                what = target
            if what is not None:
                found.append(f"{name}:{line} imports {what} from {target}")
    return found


def _layer(name: str) -> int | None:
    rest = name.split(".")[1:]
    if not rest:
        return None
    for i, names in enumerate(LAYERS):
        if rest[0] in names:
            return i
    raise AssertionError(f"{name} is in no layer of LAYERS: add it")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that go up: to a higher layer, or in the core to a later module."""
    found = []
    for name, targets in graph.items():
        mine = _layer(name)
        if mine is None:
            continue
        for target in sorted(targets):
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                found.append(f"{name} imports {target} (layer {LAYERS[theirs]} is above {LAYERS[mine]})")
            parts, tparts = name.split("."), target.split(".")
            if len(parts) > 2 and len(tparts) > 2 and parts[1] == tparts[1] == "core":
                a, b = CORE_ORDER.index(parts[2]), CORE_ORDER.index(tparts[2])
                if b > a:
                    found.append(f"{name} imports {target} (core.{tparts[2]} is above core.{parts[2]})")
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return read_modules()


def test_no_import_cycle(modules: dict[str, Module]) -> None:
    assert cycles(edges(modules)) == []


def test_every_import_of_the_package_resolves(modules: dict[str, Module]) -> None:
    assert unresolved(modules) == []


def test_no_private_name_crosses_a_package(modules: dict[str, Module]) -> None:
    assert private_imports(modules) == []


def test_imports_flow_down_the_layers(modules: dict[str, Module]) -> None:
    assert layer_violations(edges(modules)) == []


def test_every_core_module_is_in_the_core_order(modules: dict[str, Module]) -> None:
    core = {n.split(".")[2] for n in modules if n.startswith(f"{ROOT}.core.")}
    assert core == set(CORE_ORDER)


def test_no_long_file_outside_the_allowlist(modules: dict[str, Module]) -> None:
    long = {str(m.path.relative_to(SRC)): m.lines for m in modules.values() if m.lines > MAX_LINES}
    assert {p: n for p, n in long.items() if p not in LONG_FILES} == {}
    stale = [p for p in LONG_FILES if p not in long]
    assert stale == [], "allowlisted files that are no longer long: remove them from LONG_FILES"


# --- the checker itself finds what it must (each rule on a small tree written here) ---


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        path = tmp_path / ROOT / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_modules(tmp_path)


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path: Path) -> None:
    mods = _tree(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "from ..b.y import f\n",
        "b/__init__.py": "",
        "b/y.py": "def f():\n    from ..a import x\n",
    })
    assert cycles(edges(mods)) == [[f"{ROOT}.a.x", f"{ROOT}.b.y"]]


def test_a_cycle_through_a_lazy_reexport_is_found(tmp_path: Path) -> None:
    mods = _tree(tmp_path, {
        "__init__.py": "",
        "eng/__init__.py": "_LAZY = {'Omni': '.omni'}\n",
        "eng/omni.py": "from ..plan.auto import g\n",
        "plan/__init__.py": "",
        "plan/auto.py": "def g():\n    from ..eng import Omni\n",
    })
    assert cycles(edges(mods)) == [[f"{ROOT}.eng.omni", f"{ROOT}.plan.auto"]]


def test_an_import_of_a_missing_module_is_found(tmp_path: Path) -> None:
    mods = _tree(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/backends/__init__.py": "",
        "core/policy.py": "",
        "core/backends/module.py": "def f():\n    from .policy import resolve_budget\n",
    })
    assert unresolved(mods) == [
        f"{ROOT}.core.backends.module:2 imports {ROOT}.core.backends.policy, which does not exist"
    ]


def test_a_private_name_from_another_package_is_found(tmp_path: Path) -> None:
    mods = _tree(tmp_path, {
        "__init__.py": "",
        "_helpers.py": "",
        "a/__init__.py": "from .._helpers import x\n",
        "a/one.py": "_p = 1\n",
        "a/two.py": "from .one import _p\n",  # same package: allowed
        "b/__init__.py": "",
        "b/y.py": "def f():\n    from ..a.one import _p\n",
    })
    assert private_imports(mods) == [
        f"{ROOT}.a:1 imports {ROOT}._helpers from {ROOT}._helpers",
        f"{ROOT}.b.y:2 imports _p from {ROOT}.a.one",
    ]


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    mods = _tree(tmp_path, {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/hooks.py": "from .streamer import S\n",
        "core/streamer.py": "def f():\n    from ..cli import main\n",
        "cli.py": "",
    })
    assert layer_violations(edges(mods)) == [
        f"{ROOT}.core.hooks imports {ROOT}.core.streamer (core.streamer is above core.hooks)",
        f"{ROOT}.core.streamer imports {ROOT}.cli (layer ('cli', '__main__') is above ('core',))",
    ]


def test_the_paths_from_before_the_core_package_are_the_core_modules():
    """``diffusion_offload.config``, ``.hooks`` and ``.hostmem`` (the paths before the
    offload core became one package, which users' code and the shared cases import) are
    the core modules themselves: one object each, so replacing a function through either
    name changes what the engine calls."""
    import importlib

    for name in ("config", "hooks", "hostmem"):
        old = importlib.import_module(f"{ROOT}.{name}")
        assert old is importlib.import_module(f"{ROOT}.core.{name}")
