"""Llama 3 (and 3.1 / 3.2 / 3.3): the common decoder's fields, nothing of its own (its RoPE
frequency scaling, model.rope_scaling=llama3, is the default of the common fields)."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.model import ModelConfig


@dataclass(frozen=True)
class Llama3Config(ModelConfig):
    arch: str = "llama3"


CONFIG = Llama3Config
