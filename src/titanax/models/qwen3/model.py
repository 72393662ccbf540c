"""Qwen3 (dense) in Flax NNX: Llama 3's block with an RMSNorm over head_dim on every query and
key head before RoPE (q_norm / k_norm, one [head_dim] scale per layer shared by all heads,
eps = model.norm_eps), plain RoPE (theta 1e6), an explicit head_dim (128) independent of
d_model, and tied embeddings in the small sizes (model.tie_embeddings)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from titanax.config import ModelConfig
from titanax.models.decoder import Decoder
from titanax.models.layers import RMSNorm
from titanax.models.llama3.model import Block
from titanax.models.qwen3.sharding import PARAM_AXES


class Qwen3Block(Block):
    param_axes = PARAM_AXES

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        pdt, hd = jnp.dtype(cfg.param_dtype), cfg.resolved_head_dim
        self.q_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=pdt, stack=cfg.n_layers,
                              axes=PARAM_AXES["q_norm"])
        self.k_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=pdt, stack=cfg.n_layers,
                              axes=PARAM_AXES["k_norm"])

    def project_qkv(self, h_BSD):
        # RMSNorm over the last axis (head_dim) of [B, S, H, hd]: each head on its own.
        q_BSHK, k_BSHK, v_BSHK = super().project_qkv(h_BSD)
        return self.q_norm(q_BSHK), self.k_norm(k_BSHK), v_BSHK


class Qwen3(Decoder):
    block_cls = Qwen3Block
    param_axes = PARAM_AXES
