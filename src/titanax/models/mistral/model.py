"""Mistral-7B-style dense (MistralForCausalLM) in Flax NNX: the common decoder (models/common/)
as it is, as Llama 3 is: grouped-query attention, SwiGLU MLP, plain RoPE (theta 1e6 from v0.2,
1e4 in v0.1), head_dim from the config, no biases, untied output layer. Sliding-window
attention (v0.1) is not implemented: hf.py refuses such a config.json."""

from __future__ import annotations

from titanax.models.common.block import BlockOptions
from titanax.models.common.decoder import Decoder
from titanax.models.common.sharding import decoder_axes


class Mistral(Decoder):
    block_options = BlockOptions()
    param_axes = decoder_axes()
