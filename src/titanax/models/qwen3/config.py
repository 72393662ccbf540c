"""Qwen3 dense: the common decoder's fields (its per-head q/k norms are a block option of
model.py, not a field: every Qwen3 has them)."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.model import ModelConfig


@dataclass(frozen=True)
class Qwen3Config(ModelConfig):
    arch: str = "qwen3"
    rope_scaling: str = "none"  # plain RoPE: its Hugging Face form has no llama3 scaling
    ROPE_SCALINGS = ("none",)


CONFIG = Qwen3Config
