"""Mixture-of-experts feed-forward as pure functions (common/moe_block.py calls them; on a
mesh, common/moe_ep.py runs the experts on each device's own tokens): a softmax top-k router
as Mixtral's and Qwen3-MoE's, SwiGLU experts run dropless through grouped GEMMs
(jax.lax.ragged_dot over the tokens sorted by expert), the load-balancing auxiliary loss as
transformers computes it, the router z-loss, and the routing statistics the step log reports. `experts_dense` is the reference: every expert on
every token, weighted by the same gates.

Shapes: T tokens (batch x sequence flattened), D model width, F expert width, E experts, K
experts per token.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import grouped_matmul


@dataclasses.dataclass(frozen=True)
class Routing:
    """Which experts each token goes to and with what weight, and what the router's
    probabilities say about the balance."""
    expert_TK: jax.Array  # int32: each token's K experts, best first
    gate_TK: jax.Array  # float32: their weights in the token's output
    probs_TE: jax.Array  # float32: the router's softmax over all experts

    @property
    def n_experts(self) -> int:
        return self.probs_TE.shape[-1]

    def tokens_per_expert(self) -> jax.Array:
        """float32 [E]: how many (token, choice) pairs each expert receives."""
        return jnp.zeros(self.n_experts, jnp.float32).at[self.expert_TK.reshape(-1)].add(1.0)


def route(logits_TE, k: int, *, norm_topk: bool, bias_E=None) -> Routing:
    """Softmax top-k routing in float32. norm_topk: the K weights are renormalised to sum to 1
    (Mixtral always; Qwen3-MoE's norm_topk_prob); else they stay the softmax's probabilities.
    bias_E: DeepSeek-V3's auxiliary-loss-free balancing bias, added to the probabilities for
    the choice of experts only (the weights stay unbiased)."""
    probs_TE = jax.nn.softmax(logits_TE.astype(jnp.float32), axis=-1)
    choice_TE = probs_TE if bias_E is None else probs_TE + bias_E.astype(jnp.float32)
    _, expert_TK = jax.lax.top_k(choice_TE, k)
    gate_TK = jnp.take_along_axis(probs_TE, expert_TK, axis=-1)
    if norm_topk:
        gate_TK = gate_TK / jnp.sum(gate_TK, axis=-1, keepdims=True)
    return Routing(expert_TK.astype(jnp.int32), gate_TK, probs_TE)


def balance_sums(r: Routing) -> dict[str, jax.Array]:
    """This layer's share of the load-balancing loss, as sums that add over layers (and
    microbatches): (token, choice) pairs routed to each expert [E], the router probabilities
    summed over tokens [E], and the token count. transformers pools them over all layers
    before forming the loss (load_balancing_loss_func), so titanax does too."""
    return {"routed_E": jax.lax.stop_gradient(r.tokens_per_expert()),
            "prob_E": jnp.sum(r.probs_TE, axis=0),
            "rows": jnp.asarray(r.probs_TE.shape[0], jnp.float32)}


def load_balancing_loss(sums: dict[str, jax.Array]) -> jax.Array:
    """The Switch Transformer / Mixtral auxiliary loss from balance_sums (summed over the
    layers), as transformers' load_balancing_loss_func computes it before
    router_aux_loss_coef: E * sum_e (pairs routed to e / rows) * (mean probability of e).
    K when the load is even; larger when the router favours the experts it routes most to.
    Differentiable through the probabilities only (the routing is a top-k)."""
    rows = sums["rows"]
    n_experts = sums["prob_E"].shape[-1]
    return n_experts * jnp.sum((sums["routed_E"] / rows) * (sums["prob_E"] / rows))


def router_z_loss(logits_TE) -> jax.Array:
    """ST-MoE's router z-loss: the mean squared log-partition of the router logits (keeps them
    small, so the softmax stays in float32's comfortable range)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1)))


def routing_stats(r: Routing) -> dict[str, jax.Array]:
    """The step log's routing figures: the busiest expert's load over the mean load (1.0 is
    perfect balance) and the share of experts that received no token."""
    load_E = r.tokens_per_expert()
    return {"max_over_mean_load": jnp.max(load_E) / jnp.maximum(jnp.mean(load_E), 1e-9),
            "idle_expert_fraction": jnp.mean((load_E == 0).astype(jnp.float32))}


def swiglu(gate, up):
    """The experts' activation on their two projections: silu(gate) * up."""
    return jax.nn.silu(gate) * up


def grouped_mm(a_ND, w_EDF, sizes_E, *, dtype, precision=None):
    """Rows of a grouped by expert times their expert's weight: a grouped GEMM
    (pallas_kernels.grouped_matmul: XLA's ragged_dot on CPU, whose GPU lowering is a dense
    dot over every expert; a Mosaic kernel on Hopper). Accumulated in float32 and returned in
    `dtype`, as a dense layer's matmul (the [pairs, D] rows are the MoE layer's largest
    arrays: K per token); float32 under 'highest'."""
    if precision is not None:  # 'highest' (float32 checks): XLA's exact ragged_dot
        return jax.lax.ragged_dot(a_ND, w_EDF.astype(dtype), sizes_E, precision=precision,
                                  preferred_element_type=jnp.float32)
    out = grouped_matmul(a_ND.astype(dtype), w_EDF.astype(dtype), sizes_E,
                         preferred_element_type=jnp.float32)
    return out.astype(dtype)


def experts_ragged(x_TD, r: Routing, w_gate_EDF, w_up_EDF, w_down_EFD, *, dtype,
                   precision=None):
    """sum_k gate[t, k] * expert_{e[t, k]}(x[t]), dropless: the T x K (token, expert) pairs are
    sorted by expert, each expert's contiguous rows go through its SwiGLU with grouped GEMMs
    (ragged_dot: one GEMM per expert over exactly its rows, no padding to a capacity), and the
    outputs return to token order. Operands in `dtype`, accumulation in float32."""
    return experts_of_pairs(x_TD, r.expert_TK, r.gate_TK, w_gate_EDF, w_up_EDF, w_down_EFD,
                            dtype=dtype, precision=precision)


def experts_of_pairs(x_TD, expert_TK, gate_TK, w_gate_EDF, w_up_EDF, w_down_EFD, *, dtype,
                     precision=None):
    """experts_ragged on the routing's choices and weights alone (the experts' shard_map in
    common/moe_ep.py has no router probabilities): E is the weights' expert count."""
    T, K = expert_TK.shape
    flat = expert_TK.reshape(-1)
    order, inverse = sort_pairs(flat)
    sizes_E = jnp.zeros(w_gate_EDF.shape[0], jnp.int32).at[flat].add(1)
    xs_ND = gather_pairs(x_TD.astype(dtype), order, inverse, K)
    mm = lambda a, w: grouped_mm(a, w, sizes_E, dtype=dtype, precision=precision)  # noqa: E731
    h_NF = swiglu(mm(xs_ND, w_gate_EDF).astype(jnp.float32),
                  mm(xs_ND, w_up_EDF).astype(jnp.float32)).astype(dtype)
    return combine_pairs(mm(h_NF, w_down_EFD), inverse, gate_TK).astype(dtype)


# The dispatch moves [pairs, D] rows (K per token: the MoE layer's largest arrays) only by
# permutations and by gathers whose gradients are gathers too: a gather's own transpose is a
# scatter-add over rows XLA cannot know to be distinct, which its GPU lowering turns into
# several more [pairs, D] buffers (u32 indices and float32 partial sums: 17 GB each for one
# Qwen3-30B-A3B layer on 8 H100s; docs/moe.md). As MaxText's sort_activations.


def sort_pairs(flat_N):
    """(order: the pairs grouped by expert, stably; inverse: each pair's place in that order),
    int32 [N] each."""
    order = jnp.argsort(flat_N, stable=True).astype(jnp.int32)
    n = flat_N.shape[0]
    inverse = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32),
                                                    unique_indices=True)
    return order, inverse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_pairs(x_TD, order_N, inverse_N, k: int):
    """x[order // k]: each pair's token row, in expert order. Backward: the rows' cotangents
    put back in (token, choice) order and summed over each token's k choices."""
    return x_TD.at[order_N // k].get(indices_are_sorted=False)


def _gather_pairs_fwd(x_TD, order_N, inverse_N, k):
    return gather_pairs(x_TD, order_N, inverse_N, k), (inverse_N, x_TD.shape[0])


def _gather_pairs_bwd(k, res, ct_ND):
    inverse_N, tokens = res
    ct_TKD = ct_ND.at[inverse_N].get(unique_indices=True).reshape(tokens, k, -1)
    return jnp.sum(ct_TKD, axis=1, dtype=jnp.float32).astype(ct_ND.dtype), None, None


gather_pairs.defvjp(_gather_pairs_fwd, _gather_pairs_bwd)


def combine_pairs(ys_ND, inverse_N, gate_TK):
    """y[t] = sum_k gate[t, k] * ys[pair (t, k)], float32 [T, D]: the expert-ordered rows
    put back in (token, choice) order (a permutation: its gradient is the inverse one)."""
    T, K = gate_TK.shape
    ys_TKD = ys_ND.at[inverse_N].get(unique_indices=True).reshape(T, K, -1)
    return jnp.einsum("tkd,tk->td", ys_TKD, gate_TK.astype(ys_ND.dtype),
                      preferred_element_type=jnp.float32)


def experts_dense(x_TD, r: Routing, w_gate_EDF, w_up_EDF, w_down_EFD, *, dtype,
                  precision=None):
    """The reference of experts_ragged: every expert on every token ([E, T, ...]: E times the
    work), combined with the gates scattered to [T, E] (zero for experts not chosen)."""
    x = x_TD.astype(dtype)
    ein = lambda s, a, w: jnp.einsum(s, a, w.astype(dtype), precision=precision,  # noqa: E731
                                     preferred_element_type=jnp.float32)
    h_ETF = swiglu(ein("td,edf->etf", x, w_gate_EDF), ein("td,edf->etf", x, w_up_EDF))
    y_ETD = ein("etf,efd->etd", h_ETF.astype(dtype), w_down_EFD)
    T = x_TD.shape[0]
    weight_TE = jnp.zeros((T, r.n_experts), jnp.float32).at[
        jnp.arange(T)[:, None], r.expert_TK].add(r.gate_TK)
    return jnp.einsum("etd,te->td", y_ETD, weight_TE).astype(dtype)
