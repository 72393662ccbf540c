"""Mixture-of-experts feed-forward as pure functions (common/moe_block.py calls them; on a
mesh, common/moe_ep.py runs the experts on each device's own tokens): a softmax top-k router
as Mixtral's and Qwen3-MoE's, SwiGLU experts run dropless through grouped GEMMs
(jax.lax.ragged_dot over the tokens sorted by expert), the load-balancing auxiliary loss as
transformers computes it, the router z-loss, and the routing statistics the step log reports. `experts_dense` is the reference: every expert on
every token, weighted by the same gates.

Shapes in docs/architecture.md's letters: R tokens (batch x sequence flattened), A experts per
token (the router's top-k), X (token, expert) pairs (R x A, in expert order), D model width, F
expert width, E experts.
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
    expert_RA: jax.Array  # int32: each token's A experts, best first
    gate_RA: jax.Array  # float32: their weights in the token's output
    probs_RE: jax.Array  # float32: the router's softmax over all experts

    @property
    def n_experts(self) -> int:
        return self.probs_RE.shape[-1]

    def tokens_per_expert(self) -> jax.Array:
        """float32 [E]: how many (token, choice) pairs each expert receives."""
        return jnp.zeros(self.n_experts, jnp.float32).at[self.expert_RA.reshape(-1)].add(1.0)


def route(logits_RE, k: int, *, norm_topk: bool, bias_E=None) -> Routing:
    """Softmax top-k routing in float32. norm_topk: the A weights are renormalised to sum to 1
    (Mixtral always; Qwen3-MoE's norm_topk_prob); else they stay the softmax's probabilities.
    bias_E: DeepSeek-V3's auxiliary-loss-free balancing bias, added to the probabilities for
    the choice of experts only (the weights stay unbiased)."""
    probs_RE = jax.nn.softmax(logits_RE.astype(jnp.float32), axis=-1)
    choice_RE = probs_RE if bias_E is None else probs_RE + bias_E.astype(jnp.float32)
    _, expert_RA = jax.lax.top_k(choice_RE, k)
    gate_RA = jnp.take_along_axis(probs_RE, expert_RA, axis=-1)
    if norm_topk:
        gate_RA = gate_RA / jnp.sum(gate_RA, axis=-1, keepdims=True)
    return Routing(expert_RA.astype(jnp.int32), gate_RA, probs_RE)


def balance_sums(r: Routing) -> dict[str, jax.Array]:
    """This layer's share of the load-balancing loss, as sums that add over layers (and
    microbatches): (token, choice) pairs routed to each expert [E], the router probabilities
    summed over tokens [E], and the token count. transformers pools them over all layers
    before forming the loss (load_balancing_loss_func), so titanax does too."""
    return {"routed_E": jax.lax.stop_gradient(r.tokens_per_expert()),
            "prob_E": jnp.sum(r.probs_RE, axis=0),
            "rows": jnp.asarray(r.probs_RE.shape[0], jnp.float32)}


def load_balancing_loss(sums: dict[str, jax.Array]) -> jax.Array:
    """The Switch Transformer / Mixtral auxiliary loss from balance_sums (summed over the
    layers), as transformers' load_balancing_loss_func computes it before
    router_aux_loss_coef: E * sum_e (pairs routed to e / rows) * (mean probability of e).
    A when the load is even; larger when the router favours the experts it routes most to.
    Differentiable through the probabilities only (the routing is a top-k)."""
    rows = sums["rows"]
    n_experts = sums["prob_E"].shape[-1]
    return n_experts * jnp.sum((sums["routed_E"] / rows) * (sums["prob_E"] / rows))


def router_z_loss(logits_RE) -> jax.Array:
    """ST-MoE's router z-loss: the mean squared log-partition of the router logits (keeps them
    small, so the softmax stays in float32's comfortable range)."""
    return jnp.mean(jnp.square(jax.nn.logsumexp(logits_RE.astype(jnp.float32), axis=-1)))


def routing_stats(r: Routing) -> dict[str, jax.Array]:
    """The step log's routing figures: the busiest expert's load over the mean load (1.0 is
    perfect balance) and the share of experts that received no token."""
    load_E = r.tokens_per_expert()
    return {"max_over_mean_load": jnp.max(load_E) / jnp.maximum(jnp.mean(load_E), 1e-9),
            "idle_expert_fraction": jnp.mean((load_E == 0).astype(jnp.float32))}


def swiglu(gate, up):
    """The experts' activation on their two projections: silu(gate) * up."""
    return jax.nn.silu(gate) * up


def grouped_mm(a_XD, w_EDF, sizes_E, *, dtype, precision=None):
    """Rows of a grouped by expert times their expert's weight: a grouped GEMM
    (pallas_kernels.grouped_matmul: XLA's ragged_dot on CPU, whose GPU lowering is a dense
    dot over every expert; a Mosaic kernel on Hopper). Accumulated in float32 and returned in
    `dtype`, as a dense layer's matmul (the [pairs, D] rows are the MoE layer's largest
    arrays: A per token); float32 under 'highest'."""
    if precision is not None:  # 'highest' (float32 checks): XLA's exact ragged_dot
        return jax.lax.ragged_dot(a_XD, w_EDF.astype(dtype), sizes_E, precision=precision,
                                  preferred_element_type=jnp.float32)
    out = grouped_matmul(a_XD.astype(dtype), w_EDF.astype(dtype), sizes_E,
                         preferred_element_type=jnp.float32)
    return out.astype(dtype)


def experts_ragged(x_RD, r: Routing, w_gate_EDF, w_up_EDF, w_down_EFD, *, dtype,
                   precision=None):
    """sum_k gate[t, k] * expert_{e[t, k]}(x[t]), dropless: the R x A (token, expert) pairs are
    sorted by expert, each expert's contiguous rows go through its SwiGLU with grouped GEMMs
    (ragged_dot: one GEMM per expert over exactly its rows, no padding to a capacity), and the
    outputs return to token order. Operands in `dtype`, accumulation in float32."""
    return experts_of_pairs(x_RD, r.expert_RA, r.gate_RA, w_gate_EDF, w_up_EDF, w_down_EFD,
                            dtype=dtype, precision=precision)


def experts_of_pairs(x_RD, expert_RA, gate_RA, w_gate_EDF, w_up_EDF, w_down_EFD, *, dtype,
                     precision=None):
    """experts_ragged on the routing's choices and weights alone (the experts' shard_map in
    common/moe_ep.py has no router probabilities): E is the weights' expert count."""
    _, A = expert_RA.shape
    flat = expert_RA.reshape(-1)
    order, inverse = sort_pairs(flat)
    sizes_E = jnp.zeros(w_gate_EDF.shape[0], jnp.int32).at[flat].add(1)
    xs_XD = gather_pairs(x_RD.astype(dtype), order, inverse, A)
    mm = lambda a, w: grouped_mm(a, w, sizes_E, dtype=dtype, precision=precision)  # noqa: E731
    h_XF = swiglu(mm(xs_XD, w_gate_EDF).astype(jnp.float32),
                  mm(xs_XD, w_up_EDF).astype(jnp.float32)).astype(dtype)
    return combine_pairs(mm(h_XF, w_down_EFD), inverse, gate_RA).astype(dtype)


# The dispatch moves [pairs, D] rows (A per token: the MoE layer's largest arrays) only by
# permutations and by gathers whose gradients are gathers too: a gather's own transpose is a
# scatter-add over rows XLA cannot know to be distinct, which its GPU lowering turns into
# several more [pairs, D] buffers (u32 indices and float32 partial sums: 17 GB each for one
# Qwen3-30B-A3B layer on 8 H100s; docs/moe.md). As MaxText's sort_activations.


def sort_pairs(flat_X):
    """(order: the pairs grouped by expert, stably; inverse: each pair's place in that order),
    int32 [X] each."""
    order = jnp.argsort(flat_X, stable=True).astype(jnp.int32)
    n = flat_X.shape[0]
    inverse = jnp.zeros(n, jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32),
                                                    unique_indices=True)
    return order, inverse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def gather_pairs(x_RD, order_X, inverse_X, k: int):
    """x[order // k]: each pair's token row, in expert order. Backward: the rows' cotangents
    put back in (token, choice) order and summed over each token's k choices."""
    return x_RD.at[order_X // k].get(indices_are_sorted=False)


def _gather_pairs_fwd(x_RD, order_X, inverse_X, k):
    return gather_pairs(x_RD, order_X, inverse_X, k), (inverse_X, x_RD.shape[0])


def _gather_pairs_bwd(k, res, ct_XD):
    inverse_X, tokens = res
    ct_RAD = ct_XD.at[inverse_X].get(unique_indices=True).reshape(tokens, k, -1)
    return jnp.sum(ct_RAD, axis=1, dtype=jnp.float32).astype(ct_XD.dtype), None, None


gather_pairs.defvjp(_gather_pairs_fwd, _gather_pairs_bwd)


def combine_pairs(ys_XD, inverse_X, gate_RA):
    """y[t] = sum_k gate[t, k] * ys[pair (t, k)], float32 [R, D]: the expert-ordered rows
    put back in (token, choice) order (a permutation: its gradient is the inverse one)."""
    R, A = gate_RA.shape
    ys_RAD = ys_XD.at[inverse_X].get(unique_indices=True).reshape(R, A, -1)
    return jnp.einsum("rad,ra->rd", ys_RAD, gate_RA.astype(ys_XD.dtype),
                      preferred_element_type=jnp.float32)


def experts_dense(x_RD, r: Routing, w_gate_EDF, w_up_EDF, w_down_EFD, *, dtype,
                  precision=None):
    """The reference of experts_ragged: every expert on every token ([E, R, ...]: E times the
    work), combined with the gates scattered to [R, E] (zero for experts not chosen)."""
    x = x_RD.astype(dtype)
    ein = lambda s, a, w: jnp.einsum(s, a, w.astype(dtype), precision=precision,  # noqa: E731
                                     preferred_element_type=jnp.float32)
    h_ERF = swiglu(ein("rd,edf->erf", x, w_gate_EDF), ein("rd,edf->erf", x, w_up_EDF))
    y_ERD = ein("erf,efd->erd", h_ERF.astype(dtype), w_down_EFD)
    R = x_RD.shape[0]
    weight_RE = jnp.zeros((R, r.n_experts), jnp.float32).at[
        jnp.arange(R)[:, None], r.expert_RA].add(r.gate_RA)
    return jnp.einsum("erd,re->rd", y_ERD, weight_RE).astype(dtype)
