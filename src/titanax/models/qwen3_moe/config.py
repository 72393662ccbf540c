"""Qwen3-MoE: the common decoder's fields and the MoE ones (config/moe.py); model.ffn_dim is
each expert's width (config.json's moe_intermediate_size). Every layer is sparse
(decoder_sparse_step 1, no mlp_only_layers), as in the published models."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.moe import MoEModelConfig


@dataclass(frozen=True)
class Qwen3MoeConfig(MoEModelConfig):
    arch: str = "qwen3_moe"
    rope_scaling: str = "none"  # plain RoPE: its Hugging Face form has no llama3 scaling
    ROPE_SCALINGS = ("none",)


CONFIG = Qwen3MoeConfig
