"""Mixtral: the common decoder's fields and the MoE ones (config/moe.py); the top-k weights
are always renormalised (model.norm_topk_prob true)."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.model import PlainRopeModelConfig
from titanax.config.moe import MoEModelConfig


@dataclass(frozen=True)
class MixtralConfig(PlainRopeModelConfig, MoEModelConfig):
    arch: str = "mixtral"


CONFIG = MixtralConfig
