"""The attention core of the common block, after the projections: rotary embeddings on queries
and keys, then causal attention over the sequence itself (training, scoring) or over the KV
cache (decoding). Kernels plug in through titanax.ops.attention (execution.attention_impl)."""

from __future__ import annotations

import jax

from titanax import ops
from titanax.config import ExecutionConfig, ModelConfig
from titanax.models.common.layers import apply_rope, rope_inv_freq
from titanax.parallel.rules import shard_activation


def rope_inv_freq_of(cfg: ModelConfig):
    """cfg's RoPE inverse frequencies [K/2]: a numpy constant at trace time (an array attribute
    of the module would become module state)."""
    return rope_inv_freq(cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling,
                         cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                         cfg.rope_original_max_seq_len)


def rope_attention(cfg: ModelConfig, execution: ExecutionConfig, q_BSHK, k_BSNK, v_BSNK,
                   positions_BS, segment_ids_BS, kv, cache_index):
    """(attention output [B, S, H, K], the new KV cache entry or None). kv: this layer's
    (k_cache, v_cache) of [B, max_len, N, K] when decoding, None otherwise."""
    inv_freq = rope_inv_freq_of(cfg)
    q_BSHK = shard_activation(apply_rope(q_BSHK, positions_BS, inv_freq),
                              ("batch", "seq", "heads", "head_dim"))
    k_BSNK = shard_activation(apply_rope(k_BSNK, positions_BS, inv_freq),
                              ("batch", "seq", "kv_heads", "head_dim"))
    if kv is None:  # training / scoring: the sequence attends to itself
        out_BSHK = ops.attention(q_BSHK, k_BSNK, v_BSNK, impl=execution.attention_impl, causal=True,
                                 segment_ids=segment_ids_BS,
                                 context_strategy=execution.context_strategy)
        return out_BSHK, None
    # Decoding: write the new keys/values into the cache at cache_index.
    k_cache_BTNK, v_cache_BTNK = kv
    k_cache_BTNK = jax.lax.dynamic_update_slice_in_dim(
        k_cache_BTNK, k_BSNK.astype(k_cache_BTNK.dtype), cache_index, axis=1)
    v_cache_BTNK = jax.lax.dynamic_update_slice_in_dim(
        v_cache_BTNK, v_BSNK.astype(v_cache_BTNK.dtype), cache_index, axis=1)
    out_BSHK = ops.attention(q_BSHK, k_cache_BTNK, v_cache_BTNK, impl=execution.attention_impl,
                             causal=True, q_offset=cache_index,
                             kv_valid_len=cache_index + q_BSHK.shape[1])
    return out_BSHK, (k_cache_BTNK, v_cache_BTNK)
