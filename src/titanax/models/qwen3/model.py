"""Qwen3 (dense) in Flax NNX: the common decoder (models/common/) with an RMSNorm over
head_dim on every query and key head before RoPE (block option qk_norm: one [head_dim] scale
per layer shared by all heads, eps = model.norm_eps), plain RoPE (theta 1e6), an explicit
head_dim (128) independent of d_model, and tied embeddings in the small sizes
(model.tie_embeddings)."""

from __future__ import annotations

from titanax.models.common.block import BlockOptions
from titanax.models.common.decoder import Decoder
from titanax.models.common.sharding import decoder_axes


class Qwen3(Decoder):
    block_options = BlockOptions(qk_norm=True)
    param_axes = decoder_axes(qk_norm=True)
