"""The common decoder layer: pre-norm grouped-query attention with RoPE and a SwiGLU MLP, all
n_layers layers in one module (every parameter [layers, ...]), run by common/decoder.py.

Architectures configure it (BlockOptions) rather than subclass one another: Llama 3 and
Mistral use it as it is, Qwen3 turns on per-head q/k norms. Its seams for a layer that is
otherwise the same: `project_qkv` (q, k, v before RoPE), `attention` and `mlp`.

Matmuls go through titanax.ops (FP8 recipes, tensor-parallel collective matmuls) so kernels
plug in by config; parameters carry logical axis names only (common/sharding.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from titanax.config import ExecutionConfig, ModelConfig
from titanax.models.common.attention import rope_attention
from titanax.models.common.layers import RMSNorm, make_param
from titanax.models.common.linear import Projection, ProjectionOwner, projections
from titanax.models.common.lora import attach_adapters, dropout_context
from titanax.parallel.rules import shard_activation

# Each projection's einsum (x, one layer's weight -> y) and tensor-parallel role: column-
# parallel weights gather the sequence-parallel input, row-parallel ones scatter their output.
PROJECTIONS = {"wq": ("bsd,dhk->bshk", "column"), "wk": ("bsd,dhk->bshk", "column"),
               "wv": ("bsd,dhk->bshk", "column"), "wo": ("bshk,dhk->bsd", "row"),
               "w_gate": ("bsd,df->bsf", "column"), "w_up": ("bsd,df->bsf", "column"),
               "w_down": ("bsf,df->bsd", "row")}
# The einsum spec of each projection (LoRA export reads the adapters' axes from it).
PROJECTION_SPECS = {name: spec for name, (spec, _) in PROJECTIONS.items()}


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """What differs between the architectures built on this layer (not dimensions: those are
    the ModelConfig's)."""
    # RMSNorm over head_dim of every query and key head before RoPE (Qwen3): parameters
    # layers.q_norm.scale and layers.k_norm.scale, [layers, head_dim], eps model.norm_eps.
    qk_norm: bool = False


class DecoderBlock(ProjectionOwner):
    """All n_layers decoder layers at once: every parameter has a leading 'layers' axis.
    Called on one layer's slice of the state (see Decoder._layer_fn). Its projections are
    common/linear.py Projections, stored flat (wq, fp8_wq, wq_lora_a, ...)."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, options: BlockOptions,
                 axes, *, rngs: nnx.Rngs, lora=None):
        """lora: the config's lora section (LoraConfig) when lora.rank > 0: adapters on its
        target weights (common/lora.py); None: none."""
        L, D, K = cfg.n_layers, cfg.d_model, cfg.resolved_head_dim
        H, N = cfg.n_heads, cfg.n_kv_heads
        pdt = jnp.dtype(cfg.param_dtype)
        std, out_std = execution.init_std, execution.init_std / math.sqrt(2 * cfg.n_layers)
        norm = lambda name, dim: RMSNorm(dim, eps=cfg.norm_eps, param_dtype=pdt, stack=L,
                                         axes=axes[name])
        self.cfg, self.execution, self.options = cfg, execution, options
        self.attn_norm = norm("attn_norm", D)
        self.wq = self._projection("wq", make_param(rngs, (L, D, H, K), axes["wq"], std, pdt))
        self.wk = self._projection("wk", make_param(rngs, (L, D, N, K), axes["wk"], std, pdt))
        self.wv = self._projection("wv", make_param(rngs, (L, D, N, K), axes["wv"], std, pdt))
        self.wo = self._projection("wo", make_param(rngs, (L, D, H, K), axes["wo"], out_std,
                                                    pdt))
        self.mlp_norm = norm("mlp_norm", D)
        self._make_mlp(cfg, axes, rngs, std, out_std, pdt)
        if options.qk_norm:
            self.q_norm = norm("q_norm", K)
            self.k_norm = norm("k_norm", K)
        if execution.matmul_precision == "fp8_delayed":  # amax histories per FP8 call site
            for projection in projections(self):
                projection.with_fp8(execution.fp8_amax_history)
        attach_adapters(lambda name: getattr(self, name), lora, axes, rngs)

    def _projection(self, name: str, kernel: nnx.Param) -> Projection:
        spec, tp = PROJECTIONS[name]
        return Projection(name, kernel, spec, tp, self.execution)

    def _make_mlp(self, cfg: ModelConfig, axes, rngs: nnx.Rngs, std, out_std, pdt) -> None:
        """The feed-forward's weights (a subclass's own MLP, e.g. an MoE, replaces this)."""
        L, D, F = cfg.n_layers, cfg.d_model, cfg.ffn_dim
        self.w_gate = self._projection("w_gate", make_param(rngs, (L, D, F), axes["w_gate"],
                                                            std, pdt))
        self.w_up = self._projection("w_up", make_param(rngs, (L, D, F), axes["w_up"], std, pdt))
        self.w_down = self._projection("w_down", make_param(rngs, (L, D, F), axes["w_down"],
                                                            out_std, pdt))

    def project_qkv(self, h_BSD):
        """q [B, S, H, K], k and v [B, S, N, K] before RoPE; with qk_norm, q and k normalised
        over K, each head on its own."""
        q_BSHK, k_BSNK, v_BSNK = Projection.shared(h_BSD, self.wq, self.wk, self.wv)
        if self.options.qk_norm:
            q_BSHK, k_BSNK = self.q_norm(q_BSHK), self.k_norm(k_BSNK)
        return q_BSHK, k_BSNK, v_BSNK

    def attention(self, h_BSD, positions_BS, segment_ids_BS, kv, cache_index):
        """The attention sublayer's output [B, S, D] (before the residual) and the new KV."""
        q_BSHK, k_BSNK, v_BSNK = self.project_qkv(h_BSD)
        out_BSHK, new_kv = rope_attention(self.cfg, self.execution, q_BSHK, k_BSNK, v_BSNK,
                                          positions_BS, segment_ids_BS, kv, cache_index)
        return self.wo(out_BSHK), new_kv

    def mlp(self, h_BSD):
        """SwiGLU: w_down(silu(w_gate h) * w_up h)."""
        gate_BSF, up_BSF = Projection.shared(h_BSD, self.w_gate, self.w_up)
        act_BSF = shard_activation(jax.nn.silu(gate_BSF) * up_BSF, ("batch", "seq", "mlp"))
        return self.w_down(act_BSF)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, kv=None, cache_index=None,
                 lora_dropout=None):
        """lora_dropout: (the tokens' dropout keys [B, S, 2], this layer's logical index) in a
        training forward pass with lora.dropout > 0 (common/decoder.py passes it then only):
        every adapter of this layer sees it (common/lora.py dropout_context)."""
        with dropout_context(lora_dropout):
            attn_BSD, new_kv = self.attention(self.attn_norm(x_BSD), positions_BS,
                                              segment_ids_BS, kv, cache_index)
            x_BSD = shard_activation(x_BSD + attn_BSD, ("batch", "norm_seq", "embed"))
            x_BSD = x_BSD + self.mlp(self.mlp_norm(x_BSD))
        return shard_activation(x_BSD, ("batch", "norm_seq", "embed")), new_kv
