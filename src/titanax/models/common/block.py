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

from titanax import ops
from titanax.config import ExecutionConfig, ModelConfig
from titanax.models.common.attention import rope_attention
from titanax.models.common.layers import RMSNorm, make_param
from titanax.models.common.lora import adapter_delta, adapters_key, dropout_input, make_adapters
from titanax.ops.linear import linears
from titanax.parallel.rules import shard_activation

FP8_SITES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the FP8 matmuls
# Megatron tensor parallelism (parallel/rules.py): column-parallel weights gather the
# sequence-parallel input, row-parallel ones scatter their output (parallel/collective_matmul).
TP_ROLES = {"wq": "column", "wk": "column", "wv": "column", "w_gate": "column",
            "w_up": "column", "wo": "row", "w_down": "row"}
# Each projection's einsum (x, one layer's weight -> y), the one lin and lin_shared are called
# with: LoRA adapters (common/lora.py) take their input and output axes from it.
PROJECTION_SPECS = {"wq": "bsd,dhk->bshk", "wk": "bsd,dhk->bshk", "wv": "bsd,dhk->bshk",
                    "wo": "bshk,dhk->bsd", "w_gate": "bsd,df->bsf", "w_up": "bsd,df->bsf",
                    "w_down": "bsf,df->bsd"}


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """What differs between the architectures built on this layer (not dimensions: those are
    the ModelConfig's)."""
    # RMSNorm over head_dim of every query and key head before RoPE (Qwen3): parameters
    # layers.q_norm.scale and layers.k_norm.scale, [layers, head_dim], eps model.norm_eps.
    qk_norm: bool = False


class DecoderBlock(nnx.Module):
    """All n_layers decoder layers at once: every parameter has a leading 'layers' axis.
    Called on one layer's slice of the state (see Decoder._layer_fn)."""

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, options: BlockOptions,
                 axes, *, rngs: nnx.Rngs, lora=None):
        """lora: the config's lora section (LoraConfig) when lora.rank > 0: adapters
        <weight>_lora_a / _lora_b (common/lora.py) on its target weights; None: none."""
        L, D, K = cfg.n_layers, cfg.d_model, cfg.resolved_head_dim
        H, N = cfg.n_heads, cfg.n_kv_heads
        pdt = jnp.dtype(cfg.param_dtype)
        std, out_std = execution.init_std, execution.init_std / math.sqrt(2 * cfg.n_layers)
        norm = lambda name, dim: RMSNorm(dim, eps=cfg.norm_eps, param_dtype=pdt, stack=L,
                                         axes=axes[name])
        self.attn_norm = norm("attn_norm", D)
        self.wq = make_param(rngs, (L, D, H, K), axes["wq"], std, pdt)
        self.wk = make_param(rngs, (L, D, N, K), axes["wk"], std, pdt)
        self.wv = make_param(rngs, (L, D, N, K), axes["wv"], std, pdt)
        self.wo = make_param(rngs, (L, D, H, K), axes["wo"], out_std, pdt)
        self.mlp_norm = norm("mlp_norm", D)
        self._make_mlp(cfg, axes, rngs, std, out_std, pdt)
        if options.qk_norm:
            self.q_norm = norm("q_norm", K)
            self.k_norm = norm("k_norm", K)
        if execution.matmul_precision == "fp8_delayed":  # amax histories per FP8 call site
            for name in FP8_SITES:
                setattr(self, f"fp8_{name}", ops.make_fp8_meta(L, execution.fp8_amax_history))
        if lora is not None and lora.enabled:
            self._add_adapters(lora, axes, rngs)
        self.cfg, self.execution, self.options = cfg, execution, options

    def _make_mlp(self, cfg: ModelConfig, axes, rngs: nnx.Rngs, std, out_std, pdt) -> None:
        """The feed-forward's weights (a subclass's own MLP, e.g. an MoE, replaces this)."""
        L, D, F = cfg.n_layers, cfg.d_model, cfg.ffn_dim
        self.w_gate = make_param(rngs, (L, D, F), axes["w_gate"], std, pdt)
        self.w_up = make_param(rngs, (L, D, F), axes["w_up"], std, pdt)
        self.w_down = make_param(rngs, (L, D, F), axes["w_down"], out_std, pdt)

    def _add_adapters(self, lora, axes, rngs: nnx.Rngs) -> None:
        key = adapters_key(rngs)
        for i, name in enumerate(lora.weights):
            a, b = make_adapters(jax.random.fold_in(key, i), getattr(self, name).shape,
                                 axes[name], PROJECTION_SPECS[name], lora.rank)
            setattr(self, f"{name}_lora_a", a)
            setattr(self, f"{name}_lora_b", b)
        self.lora_scale, self.lora_dropout = lora.scale, lora.dropout

    def _adapted(self, y, x, name: str, spec: str, drop=None):
        """y (= x W of weight `name`) plus its LoRA adapter's scale * (x A) B, if it has one.
        drop: (the tokens' dropout keys [B, S, 2], this layer's logical index) in a training
        forward pass with lora.dropout > 0: the adapter then sees dropout(x), the base x."""
        a = getattr(self, f"{name}_lora_a", None)
        if a is None:
            return y
        if drop is not None and self.lora_dropout > 0:
            x = dropout_input(x, *drop, name, self.lora_dropout)
        return y + adapter_delta(x, a[...], getattr(self, f"{name}_lora_b")[...], spec,
                                 self.lora_scale, y.dtype)

    def _meta(self, name):
        """This layer's amax histories for weight `name` (fp8_delayed), else None."""
        meta = getattr(self, f"fp8_{name}", None)
        return None if meta is None else ops.fp8_meta_dict(meta[...])

    def lin(self, x, name: str, spec: str, drop=None):
        """x times weight `name` in the compute dtype or an FP8 recipe, with this call site's
        amax histories (drop: adapter dropout's inputs, see _adapted)."""
        ex = self.execution
        y = ops.linear(x, getattr(self, name)[...], spec, precision=ex.matmul_precision,
                       dtype=jnp.dtype(ex.dtype), fp8_meta=self._meta(name),
                       grad_reduce=ex.grad_reduce_dtype,
                       mxfp8_scale_rounding=ex.mxfp8_scale_rounding, tp=TP_ROLES.get(name))
        return self._adapted(y, x, name, spec, drop)

    def lin_shared(self, x, names: tuple[str, ...], spec: str, drop=None) -> tuple:
        """lin of one input with several weights (q/k/v, gate/up): under a collective matmul
        (parallel/collective_matmul.py) they share one ring."""
        ex = self.execution
        ys = linears(x, [getattr(self, n)[...] for n in names], spec,
                     precision=ex.matmul_precision, dtype=jnp.dtype(ex.dtype),
                     fp8_metas=[self._meta(n) for n in names], grad_reduce=ex.grad_reduce_dtype,
                     mxfp8_scale_rounding=ex.mxfp8_scale_rounding, tp=TP_ROLES[names[0]])
        return tuple(self._adapted(y, x, n, spec, drop) for y, n in zip(ys, names, strict=True))

    def project_qkv(self, h_BSD, drop=None):
        """q [B, S, H, K], k and v [B, S, N, K] before RoPE; with qk_norm, q and k normalised
        over K, each head on its own. drop (here and below): adapter dropout's inputs or None
        (see _adapted)."""
        q_BSHK, k_BSNK, v_BSNK = self.lin_shared(h_BSD, ("wq", "wk", "wv"),
                                                PROJECTION_SPECS["wq"], drop)
        if self.options.qk_norm:
            q_BSHK, k_BSNK = self.q_norm(q_BSHK), self.k_norm(k_BSNK)
        return q_BSHK, k_BSNK, v_BSNK

    def attention(self, h_BSD, positions_BS, segment_ids_BS, kv, cache_index, drop=None):
        """The attention sublayer's output [B, S, D] (before the residual) and the new KV."""
        q_BSHK, k_BSNK, v_BSNK = self.project_qkv(h_BSD, drop)
        out_BSHK, new_kv = rope_attention(self.cfg, self.execution, q_BSHK, k_BSNK, v_BSNK,
                                          positions_BS, segment_ids_BS, kv, cache_index)
        return self.lin(out_BSHK, "wo", PROJECTION_SPECS["wo"], drop), new_kv

    def mlp(self, h_BSD, drop=None):
        """SwiGLU: w_down(silu(w_gate h) * w_up h)."""
        gate_BSF, up_BSF = self.lin_shared(h_BSD, ("w_gate", "w_up"), PROJECTION_SPECS["w_gate"],
                                           drop)
        act_BSF = shard_activation(jax.nn.silu(gate_BSF) * up_BSF, ("batch", "seq", "mlp"))
        return self.lin(act_BSF, "w_down", PROJECTION_SPECS["w_down"], drop)

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, kv=None, cache_index=None,
                 lora_dropout=None):
        """lora_dropout: (the tokens' dropout keys [B, S, 2], this layer's logical index) in a
        training forward pass with lora.dropout > 0 (common/decoder.py passes it then only)."""
        attn_BSD, new_kv = self.attention(self.attn_norm(x_BSD), positions_BS, segment_ids_BS,
                                          kv, cache_index, lora_dropout)
        x_BSD = shard_activation(x_BSD + attn_BSD, ("batch", "norm_seq", "embed"))
        x_BSD = x_BSD + self.mlp(self.mlp_norm(x_BSD), lora_dropout)
        return shard_activation(x_BSD, ("batch", "norm_seq", "embed")), new_kv
