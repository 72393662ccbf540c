"""Qwen3-MoE: the common decoder's fields and the MoE ones (config/moe.py); model.ffn_dim is
each expert's width (config.json's moe_intermediate_size). Every layer is sparse
(decoder_sparse_step 1, no mlp_only_layers), as in the published models."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.model import PlainRopeModelConfig
from titanax.config.moe import MoEModelConfig


@dataclass(frozen=True)
class Qwen3MoeConfig(PlainRopeModelConfig, MoEModelConfig):
    arch: str = "qwen3_moe"


CONFIG = Qwen3MoeConfig
