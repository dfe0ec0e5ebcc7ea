"""Lazy exports for the packages' ``__init__`` modules.

A package's ``__init__`` is its contract: the names it exports. Most of them live in modules
that import torch (seconds), which a command that makes no tensor (``maxent-arrow query``,
``--help``) must not pay for. So an ``__init__`` declares where each name lives and the module
is imported on first access of one of its names (PEP 562), then the name is cached on the
package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["exports"]


def exports(
    package: str, where: Mapping[str, Sequence[str]]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package``.

    ``where`` maps a submodule (relative, e.g. ``".ragged"``) to the names it defines that the
    package exports.
    """
    home: dict[str, str] = {}
    for module, names in where.items():
        for name in names:
            if name in home:
                raise ValueError(f"{package}: {name!r} exported from two modules")
            home[name] = module

    def getattr_(name: str) -> Any:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(home))

    return sorted(home), getattr_, dir_
