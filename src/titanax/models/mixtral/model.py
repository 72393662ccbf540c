"""Mixtral in Flax NNX: Llama's attention (GQA, RoPE theta 1e6, no biases) and a
mixture-of-experts feed-forward in every layer: a softmax top-2 router over 8 SwiGLU experts,
the two weights renormalised (models/common/moe_block.py)."""

from __future__ import annotations

from titanax.models.common.block import BlockOptions
from titanax.models.common.decoder import Decoder
from titanax.models.common.moe_block import MoEBlock
from titanax.models.common.sharding import moe_decoder_axes


class Mixtral(Decoder):
    block_cls = MoEBlock
    block_options = BlockOptions()
    param_axes = moe_decoder_axes()
