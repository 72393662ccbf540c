"""The common decoder layer with a mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): the
attention of common/block.py unchanged, then a softmax top-k router over model.n_experts
SwiGLU experts run dropless (common/moe.py). Besides (x, kv) each layer returns its routing
sums (AUX_KEYS), which the decoder adds over the layers: the load-balancing loss is formed
once from the pooled sums, as transformers forms it.

Parameters ([layers, ...] as every block parameter): router [L, D, E]; w_gate, w_up
[L, E, D, F]; w_down [L, E, F, D] (ragged_dot's [groups, in, out]); with
model.router_bias_update_rate > 0 also router_bias [L, E] (common/moe_bias.py). The attention's
wq..wo are the common block's Projections (common/linear.py); the router (a float32 einsum)
and the experts (grouped ragged_dot GEMMs, which have no FP8 recipe or adapters yet: the
config refuses both for MoE) are a different kind of matmul and stay bare parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from titanax.models.common.block import DecoderBlock
from titanax.models.common.layers import make_param
from titanax.models.common.moe import balance_sums, experts_ragged, route, routing_stats
from titanax.models.common.moe_bias import make_router_bias, probe
from titanax.models.common.moe_ep import experts_sharded, on_mesh
from titanax.models.spec import PROBE
from titanax.parallel.rules import expert_weight_axes, shard_activation


class MoEBlock(DecoderBlock):
    """DecoderBlock whose feed-forward is an MoE; cfg is a MoEModelConfig."""

    def _make_mlp(self, cfg, axes, rngs: nnx.Rngs, std, out_std, pdt) -> None:
        L, E, D, F = cfg.n_layers, cfg.n_experts, cfg.d_model, cfg.ffn_dim
        self.router = make_param(rngs, (L, D, E), axes["router"], std, pdt)
        stored = lambda name: expert_weight_axes(axes[name], E)  # noqa: E731
        self.w_gate = make_param(rngs, (L, E, D, F), stored("w_gate"), std, pdt)
        self.w_up = make_param(rngs, (L, E, D, F), stored("w_up"), std, pdt)
        self.w_down = make_param(rngs, (L, E, F, D), stored("w_down"), out_std, pdt)
        if cfg.router_bias_update_rate > 0:  # DeepSeek-V3's balancing (common/moe_bias.py)
            self.router_bias = make_router_bias(L, E, axes["router_bias"])

    def aux_zeros(self) -> dict:
        """The routing sums before the first layer (what __call__'s third output adds to)."""
        E, zero = self.cfg.n_experts, jnp.zeros((), jnp.float32)
        sums = {"routed_E": jnp.zeros(E, jnp.float32), "prob_E": jnp.zeros(E, jnp.float32),
                "rows": zero, "z_sum": zero, "max_over_mean_load": zero, "dropped": zero}
        return {**sums, PROBE: zero} if self._biased else sums

    @property
    def _biased(self) -> bool:
        return self.cfg.router_bias_update_rate > 0

    def moe(self, h_BSD):
        """(the feed-forward's output [B, S, D], this layer's routing sums)."""
        cfg, ex = self.cfg, self.execution
        B, S, D = h_BSD.shape
        precision = "highest" if ex.matmul_precision == "highest" else None
        h_RD = h_BSD.reshape(B * S, D)
        # The router in float32 (a few thousand FLOPs per token; its softmax decides routing).
        logits_RE = jnp.einsum("rd,de->re", h_RD.astype(jnp.float32),
                               self.router[...].astype(jnp.float32), precision=precision)
        bias_E = self.router_bias[...] if self._biased else None
        r = route(logits_RE, cfg.experts_per_token, norm_topk=cfg.norm_topk_prob, bias_E=bias_E)
        weights = (self.w_gate[...], self.w_up[...], self.w_down[...])
        if on_mesh():  # each device dispatches its own tokens (common/moe_ep.py)
            y_BSD, dropped = experts_sharded(
                h_BSD, r, *weights, dtype=jnp.dtype(ex.dtype), precision=precision,
                capacity_factor=ex.expert_capacity_factor or None)
        else:
            y_BSD = experts_ragged(h_RD, r, *weights, dtype=jnp.dtype(ex.dtype),
                                   precision=precision).reshape(B, S, D)
            dropped = jnp.zeros((), jnp.float32)
        aux = {**balance_sums(r), "dropped": jax.lax.stop_gradient(dropped),
               "z_sum": jnp.sum(jnp.square(jax.nn.logsumexp(logits_RE, axis=-1))),
               # Weighted by the tokens: the log's mean over layers and pipeline microbatches.
               "max_over_mean_load": jax.lax.stop_gradient(
                   routing_stats(r)["max_over_mean_load"]) * (B * S)}
        if self._biased:  # the bias's "gradient": this layer's tokens per expert
            aux[PROBE] = probe(bias_E, r.tokens_per_expert())
        return y_BSD, aux

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, kv=None, cache_index=None,
                 lora_dropout=None):
        """(x after the layer, the new KV, this layer's routing sums)."""
        attn_BSD, new_kv = self.attention(self.attn_norm(x_BSD), positions_BS, segment_ids_BS,
                                          kv, cache_index)
        x_BSD = shard_activation(x_BSD + attn_BSD, ("batch", "norm_seq", "embed"))
        y_BSD, aux = self.moe(self.mlp_norm(x_BSD))
        return shard_activation(x_BSD + y_BSD, ("batch", "norm_seq", "embed")), new_kv, aux
