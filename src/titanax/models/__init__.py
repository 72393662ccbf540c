"""One folder per architecture (e.g. llama3/), registered in titanax/archs.py, each configuring the
shared pieces in common/ (layers, attention, the decoder block and stack, HF tables); spec.py
is what the rest of titanax asks of an architecture; accumulate.py is the in-place gradient
sum the decoder stack runs under train.grad_accum."""

from __future__ import annotations

from titanax.archs import ARCHS
from titanax.config import ModelConfig
from titanax.config.model import arch_config_class
from titanax.models.registry import model_spec

__all__ = ["model_spec", "preset"]


def preset(name: str, **overrides) -> ModelConfig:
    """The model section of preset `name`, an instance of its architecture's config class
    (model.arch set to that one), with `overrides` applied."""
    specs = [model_spec(arch) for arch in ARCHS]
    for spec in specs:
        if name in spec.presets:
            fields = {**spec.presets[name], **overrides, "arch": spec.arch}
            return arch_config_class(spec.arch)(**fields)
    known = sorted(n for spec in specs for n in spec.presets)
    raise KeyError(f"unknown model preset {name!r}; known: {known}")
