"""model.arch -> the architecture's ModelSpec (SPEC in PACKAGE.spec, PACKAGE from
titanax/archs.py's one line per architecture). Imported lazily, so the names can be listed
without importing any model code."""

from __future__ import annotations

import importlib

from titanax.archs import ARCHS
from titanax.config.model import arch_config_class


def model_spec(arch_or_cfg):
    """The ModelSpec for an arch name or a ModelConfig (its model.arch); a ConfigError naming
    the field for an unknown one."""
    arch = arch_or_cfg if isinstance(arch_or_cfg, str) else getattr(arch_or_cfg, "arch", "llama3")
    arch_config_class(arch)  # a ConfigError naming model.arch for an unknown one
    return importlib.import_module(f"{ARCHS[arch]}.spec").SPEC


def spec_for_hf(model_type: str | None):
    """The ModelSpec whose HF interop reads config.json's `model_type` (None: llama3, as
    config.json files without one are Llama)."""
    specs = [model_spec(arch) for arch in ARCHS]
    for spec in specs:
        if spec.hf is not None and spec.hf.model_type == (model_type or "llama"):
            return spec
    known = sorted(s.hf.model_type for s in specs if s.hf is not None)
    raise ValueError(f"model_type {model_type!r} is not supported; titanax imports {known} "
                     "(titanax/archs.py)")
