"""model.arch -> the architecture's ModelSpec. One line per architecture; the package named
here defines SPEC. Imported lazily, so the names can be listed without importing any model
code."""

from __future__ import annotations

import difflib
import importlib

ARCHS: dict[str, str] = {
    "llama3": "titanax.models.llama3",
    "qwen3": "titanax.models.qwen3",
    "mistral": "titanax.models.mistral",
}


def model_spec(arch_or_cfg):
    """The ModelSpec for an arch name or a ModelConfig (its model.arch); a ConfigError naming
    the field for an unknown one."""
    arch = arch_or_cfg if isinstance(arch_or_cfg, str) else getattr(arch_or_cfg, "arch", "llama3")
    if arch not in ARCHS:
        from titanax.config import ConfigError

        close = difflib.get_close_matches(arch, ARCHS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"model.arch: {arch!r} is not one of {sorted(ARCHS)} (registered in "
                          f"models/registry.py).{hint}")
    return importlib.import_module(ARCHS[arch]).SPEC


def spec_for_hf(model_type: str | None):
    """The ModelSpec whose HF interop reads config.json's `model_type` (None: llama3, as
    config.json files without one are Llama)."""
    specs = [model_spec(arch) for arch in ARCHS]
    for spec in specs:
        if spec.hf is not None and spec.hf.model_type == (model_type or "llama"):
            return spec
    known = sorted(s.hf.model_type for s in specs if s.hf is not None)
    raise ValueError(f"model_type {model_type!r} is not supported; titanax imports {known} "
                     "(models/registry.py)")
