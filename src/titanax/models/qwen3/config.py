"""Qwen3 dense: the common decoder's fields (its per-head q/k norms are a block option of
model.py, not a field: every Qwen3 has them)."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.model import PlainRopeModelConfig


@dataclass(frozen=True)
class Qwen3Config(PlainRopeModelConfig):
    arch: str = "qwen3"


CONFIG = Qwen3Config
