"""Qwen3-MoE in Flax NNX: Qwen3's attention (an RMSNorm over head_dim on every query and key
head before RoPE, head_dim 128 independent of d_model) and a mixture-of-experts feed-forward in
every layer: a softmax top-8 router over 128 SwiGLU experts (models/common/moe_block.py)."""

from __future__ import annotations

from titanax.models.common.block import BlockOptions
from titanax.models.common.decoder import Decoder
from titanax.models.common.moe_block import MoEBlock
from titanax.models.common.sharding import moe_decoder_axes


class Qwen3Moe(Decoder):
    block_cls = MoEBlock
    block_options = BlockOptions(qk_norm=True)
    param_axes = moe_decoder_axes(qk_norm=True)
