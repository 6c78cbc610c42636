"""A package's names imported when first asked for (PEP 562's module ``__getattr__``), so that
importing one light submodule (a config's choices, which the command line's parser reads) does
not import the package's torch-heavy ones."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, sources: dict[str, list[str]]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: each name listed under a module of ``sources`` (its
    full dotted path -> names) imported from it at first use, and kept in the package."""
    where = {name: module for module, names in sources.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(importlib.import_module(package), name, value)
        return value
    return __getattr__
