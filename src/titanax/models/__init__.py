"""One folder per architecture (e.g. llama3/), registered in registry.py, each configuring the
shared pieces in common/ (layers, attention, the decoder block and stack, HF tables); spec.py
is what the rest of titanax asks of an architecture; accumulate.py is the in-place gradient
sum the decoder stack runs under train.grad_accum."""

from __future__ import annotations

import dataclasses

from titanax.config import ModelConfig
from titanax.models.registry import ARCHS, model_spec

__all__ = ["model_spec", "preset"]


def preset(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of preset `name`, whichever architecture defines it (model.arch set to
    that one), with `overrides` applied."""
    specs = [model_spec(arch) for arch in ARCHS]
    for spec in specs:
        if name in spec.presets:
            fields = {"arch": spec.arch, **spec.presets[name]}
            return dataclasses.replace(ModelConfig(**fields), **overrides)
    known = sorted(n for spec in specs for n in spec.presets)
    raise KeyError(f"unknown model preset {name!r}; known: {known}")
