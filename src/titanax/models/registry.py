"""model.arch -> the architecture's ModelSpec. One line per architecture; the module named
here defines SPEC. Imported lazily, so config validation can list the names without importing
any model code."""

from __future__ import annotations

import importlib

ARCHS: dict[str, str] = {
    "llama3": "titanax.models.llama",
}


def model_spec(arch_or_cfg):
    """The ModelSpec for an arch name or a ModelConfig (its model.arch)."""
    arch = arch_or_cfg if isinstance(arch_or_cfg, str) else getattr(arch_or_cfg, "arch", "llama3")
    if arch not in ARCHS:
        raise KeyError(f"model.arch {arch!r} is not registered; known: {sorted(ARCHS)} "
                       "(models/registry.py)")
    return importlib.import_module(ARCHS[arch]).SPEC
