"""A package's names loaded on first use (PEP 562), from a table {name: relative module}:
titanax.config reads the kernels' backend tables (plain data) through the packages without
importing jax. Imports nothing but importlib and sys itself, so it stays jax-free."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(module_name: str, exports: dict[str, str]):
    """(__getattr__, __dir__, __all__) for the package `module_name` (its __name__): a name of
    `exports` is imported from its module (relative to the package) when first asked for."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], module_name), name)

    def __dir__():
        return sorted(set(vars(sys.modules[module_name])) | set(exports))

    return __getattr__, __dir__, sorted(exports)
