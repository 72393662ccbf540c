"""Llama 3 (and 3.1 / 3.2 / 3.3) in Flax NNX: the common decoder (models/common/) as it is:
RMSNorm, RoPE (llama3 scaling), grouped-query attention, SwiGLU MLP, the output layer untied
(or tied: model.tie_embeddings, Llama 3.2 1B/3B)."""

from __future__ import annotations

from titanax.models.common.block import BlockOptions
from titanax.models.common.decoder import Decoder
from titanax.models.common.sharding import decoder_axes


class Llama(Decoder):
    block_options = BlockOptions()
    param_axes = decoder_axes()
