"""Llama 3 in Flax NNX: RMSNorm, RoPE (llama3 scaling), grouped-query attention, SwiGLU MLP,
output layer untied (or tied: model.tie_embeddings, Llama 3.2 1B/3B). The layers are one
stacked Block (parameters [layers, ...]) run by the shared decoder (models/decoder.py).

Parameters carry logical axis names only (sharding.py); parallel/rules.py maps them to the
mesh. Matmuls and attention go through titanax.ops so kernels plug in by config.

Block's seams for architectures built on it (a Llama-shaped layer with a twist): `project_qkv` (q, k, v before
RoPE), `attention` and `mlp`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from titanax import ops
from titanax.config import ModelConfig
from titanax.models.decoder import Decoder, make_param
from titanax.models.layers import RMSNorm, apply_rope, rope_inv_freq
from titanax.models.llama3.sharding import PARAM_AXES
from titanax.ops.linear import linears
from titanax.parallel.rules import shard_activation

FP8_SITES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the FP8 matmuls
# Megatron tensor parallelism (parallel/rules.py): column-parallel weights gather the
# sequence-parallel input, row-parallel ones scatter their output (parallel/collective_matmul).
TP_ROLES = {"wq": "column", "wk": "column", "wv": "column", "w_gate": "column",
            "w_up": "column", "wo": "row", "w_down": "row"}


class Block(nnx.Module):
    """All n_layers decoder layers at once: every parameter has a leading 'layers' axis.
    Called on one layer's slice of the state (see Decoder._layer_fn)."""

    param_axes = PARAM_AXES

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        L, d, hd, F = cfg.n_layers, cfg.d_model, cfg.resolved_head_dim, cfg.ffn_dim
        Hq, Hkv, ax = cfg.n_heads, cfg.n_kv_heads, self.param_axes
        pdt = jnp.dtype(cfg.param_dtype)
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        norm = lambda name: RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt, stack=L,
                                    axes=ax[name])
        self.attn_norm = norm("attn_norm")
        self.wq = make_param(rngs, (L, d, Hq, hd), ax["wq"], std, pdt)
        self.wk = make_param(rngs, (L, d, Hkv, hd), ax["wk"], std, pdt)
        self.wv = make_param(rngs, (L, d, Hkv, hd), ax["wv"], std, pdt)
        self.wo = make_param(rngs, (L, d, Hq, hd), ax["wo"], out_std, pdt)
        self.mlp_norm = norm("mlp_norm")
        self.w_gate = make_param(rngs, (L, d, F), ax["w_gate"], std, pdt)
        self.w_up = make_param(rngs, (L, d, F), ax["w_up"], std, pdt)
        self.w_down = make_param(rngs, (L, d, F), ax["w_down"], out_std, pdt)
        if cfg.matmul_precision == "fp8_delayed":  # amax histories per FP8 call site
            for name in FP8_SITES:
                setattr(self, f"fp8_{name}", ops.make_fp8_meta(L, cfg.fp8_amax_history))
        self.cfg = cfg

    def _meta(self, name):
        """This layer's amax histories for weight `name` (fp8_delayed), else None."""
        meta = getattr(self, f"fp8_{name}", None)
        return None if meta is None else ops.fp8_meta_dict(meta[...])

    def lin(self, x, name: str, spec: str):
        """x times weight `name` in the compute dtype or an FP8 recipe, with this call site's
        amax histories."""
        cfg = self.cfg
        return ops.linear(x, getattr(self, name)[...], spec, precision=cfg.matmul_precision,
                          dtype=jnp.dtype(cfg.dtype), fp8_meta=self._meta(name),
                          grad_reduce=cfg.grad_reduce_dtype,
                          mxfp8_scale_rounding=cfg.mxfp8_scale_rounding, tp=TP_ROLES.get(name))

    def lin_shared(self, x, names: tuple[str, ...], spec: str) -> tuple:
        """lin of one input with several weights (q/k/v, gate/up): under a collective matmul
        (parallel/collective_matmul.py) they share one ring."""
        cfg = self.cfg
        return linears(x, [getattr(self, n)[...] for n in names], spec,
                       precision=cfg.matmul_precision, dtype=jnp.dtype(cfg.dtype),
                       fp8_metas=[self._meta(n) for n in names], grad_reduce=cfg.grad_reduce_dtype,
                       mxfp8_scale_rounding=cfg.mxfp8_scale_rounding, tp=TP_ROLES[names[0]])

    def project_qkv(self, h_BSD):
        """q [B, S, Hq, hd], k and v [B, S, Hkv, hd] before RoPE (the seam per-head q/k norms
        override)."""
        return self.lin_shared(h_BSD, ("wq", "wk", "wv"), "bsd,dhk->bshk")

    def attention(self, h_BSD, positions_BS, segment_ids_BS, kv, cache_index):
        """The attention sublayer's output [B, S, d] (before the residual) and the new KV."""
        cfg = self.cfg
        # A numpy constant at trace time (an array attribute would become module state).
        inv_freq = rope_inv_freq(cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                 cfg.rope_factor, cfg.rope_low_freq_factor,
                                 cfg.rope_high_freq_factor, cfg.rope_original_max_seq_len)
        q_BSHK, k_BSHK, v_BSHK = self.project_qkv(h_BSD)
        q_BSHK = shard_activation(apply_rope(q_BSHK, positions_BS, inv_freq),
                                  ("batch", "seq", "heads", "head_dim"))
        k_BSHK = shard_activation(apply_rope(k_BSHK, positions_BS, inv_freq),
                                  ("batch", "seq", "kv_heads", "head_dim"))
        if kv is None:  # training / scoring: the sequence attends to itself
            new_kv = None
            out_BSHK = ops.attention(q_BSHK, k_BSHK, v_BSHK, impl=cfg.attention_impl,
                                     causal=True, segment_ids=segment_ids_BS,
                                     context_strategy=cfg.context_strategy)
        else:  # decoding: write the new keys/values into the cache at cache_index
            k_cache, v_cache = kv
            k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k_BSHK.astype(k_cache.dtype), cache_index, axis=1)
            v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v_BSHK.astype(v_cache.dtype), cache_index, axis=1)
            new_kv = (k_cache, v_cache)
            out_BSHK = ops.attention(q_BSHK, k_cache, v_cache, impl=cfg.attention_impl,
                                     causal=True, q_offset=cache_index,
                                     kv_valid_len=cache_index + q_BSHK.shape[1])
        return self.lin(out_BSHK, "wo", "bshk,dhk->bsd"), new_kv

    def mlp(self, h_BSD):
        """SwiGLU: w_down(silu(w_gate h) * w_up h)."""
        gate_BSF, up_BSF = self.lin_shared(h_BSD, ("w_gate", "w_up"), "bsd,df->bsf")
        act_BSF = shard_activation(jax.nn.silu(gate_BSF) * up_BSF, ("batch", "seq", "mlp"))
        return self.lin(act_BSF, "w_down", "bsf,df->bsd")

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, kv=None, cache_index=None):
        attn_BSD, new_kv = self.attention(self.attn_norm(x_BSD), positions_BS, segment_ids_BS,
                                          kv, cache_index)
        x_BSD = shard_activation(x_BSD + attn_BSD, ("batch", "norm_seq", "embed"))
        x_BSD = x_BSD + self.mlp(self.mlp_norm(x_BSD))
        return shard_activation(x_BSD, ("batch", "norm_seq", "embed")), new_kv


class Llama(Decoder):
    block_cls = Block
    param_axes = PARAM_AXES
