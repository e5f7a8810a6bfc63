"""A package's public names imported on first use (PEP 562), so importing the package loads none of
its modules: the answers that need no torch (``hookloop config``, refusals) stay free of it.

    __getattr__, __dir__ = lazy_exports(__name__, {"Trainer": "hookloop.engine.trainer", ...})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["homes_of", "lazy_exports"]


def homes_of(package: str, modules: Mapping[str, tuple[str, ...]]) -> dict[str, str]:
    """``{name: module}`` from ``{module of package: (names, ...)}``."""
    return {name: f"{package}.{module}" for module, names in modules.items() for name in names}


def lazy_exports(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package``: each name of ``homes`` (name ->
    the module it lives in) imported from its module on first use and kept in the package."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
