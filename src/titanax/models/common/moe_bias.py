"""DeepSeek-V3's auxiliary-loss-free load balancing (model.router_bias_update_rate > 0; Wang
et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"): every
layer has a bias [E] that the router adds to its probabilities when it chooses the experts
(common/moe.py `route`; the gates stay unbiased), and after each step it moves by the rate
towards balance, as TorchTitan's MoE does: up for the experts that got fewer than the layer's
mean load, down for those that got more, centred so the biases keep a zero mean.

The step's loads reach the bias as its gradient: each layer adds `probe` to its routing sums,
a term of value 0 whose derivative with respect to the bias is the layer's tokens per expert.
So the loads are summed over microbatches, devices and pipeline stages (idle ticks masked)
exactly as gradients are, and the train step (train/step.py, through the SelfUpdated hook)
takes them out before the optimizer and applies `updated_bias`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from titanax.models.spec import SelfUpdated

BIAS = "router_bias"  # the MoE block's attribute: params['layers']['router_bias'], [L, E]


def make_router_bias(n_layers: int, n_experts: int, names: tuple[str, ...]) -> nnx.Param:
    """The biases of every layer, zero (the plain router) and float32 whatever
    model.param_dtype: steps of the rate (1e-3) would vanish in bfloat16 next to a bias of
    0.1."""
    return nnx.Param(jnp.zeros((n_layers, n_experts), jnp.float32), out_sharding=names)


def probe(bias_E, tokens_per_expert_E) -> jax.Array:
    """0.0, whose gradient with respect to bias_E is tokens_per_expert_E (the layer's load)."""
    x = jnp.sum(bias_E * jax.lax.stop_gradient(tokens_per_expert_E))
    return x - jax.lax.stop_gradient(x)


def updated_bias(bias_LE, load_LE, rate: float) -> jax.Array:
    """Each layer's bias after a step whose tokens per expert were load_LE: rate x sign(mean
    load - load) added, less its mean over the experts (TorchTitan's update)."""
    load_LE = load_LE.astype(jnp.float32)
    delta_LE = rate * jnp.sign(jnp.mean(load_LE, axis=-1, keepdims=True) - load_LE)
    return bias_LE + delta_LE - jnp.mean(delta_LE, axis=-1, keepdims=True)


def moe_self_updated(cfg) -> SelfUpdated | None:
    """The ModelSpec hook: the routing bias when model.router_bias_update_rate > 0."""
    rate = cfg.router_bias_update_rate
    if rate <= 0:
        return None
    return SelfUpdated(selects=lambda path: path[-1:] == (BIAS,),
                       update=lambda bias, load: updated_bias(bias, load, rate),
                       what=f"model.router_bias_update_rate={rate}: the routing bias that "
                            "decides which experts each token uses",
                       lost_effect="route differently")
