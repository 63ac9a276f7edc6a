"""PEP 562 lazy exports: a package's public names are imported from their submodules on
first use, so importing the package (``--help``, ``--version``) does not import torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, names: Mapping[str, str], public: list[str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``.

    Args:
        package: the package's ``__name__``.
        names: public name -> the relative submodule that defines it (``".core.hooks"``; ``"..models.files"`` for a sibling package).
        public: the package's ``__all__``.
        namespace: the package's ``globals()``; a name is cached there once imported.

    ``__getattr__`` raises AttributeError for a name not in ``names``.
    """

    def __getattr__(name: str) -> Any:  # noqa: N807
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(namespace) | set(public))

    return __getattr__, __dir__
