"""The mixture-of-experts functions (models/common/moe.py, issue 37): the dropless grouped-GEMM
experts equal every expert run densely on every token, values and gradients; routing follows
Mixtral (renormalised top-k) and Qwen3-MoE (optionally not); the load-balancing loss equals a
numpy transcription of transformers' load_balancing_loss_func pooled over layers; the
auxiliary-loss-free bias moves the choice and not the weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax.models.common.moe import (
    balance_sums,
    experts_dense,
    experts_ragged,
    load_balancing_loss,
    route,
    router_z_loss,
    routing_stats,
)

T, D, F, E, K = 24, 16, 32, 4, 2


def _weights(seed=0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (T, D))
    router = jax.random.normal(ks[1], (D, E))
    gate, up = (jax.random.normal(k, (E, D, F)) / np.sqrt(D) for k in ks[2:4])
    down = jax.random.normal(ks[4], (E, F, D)) / np.sqrt(F)
    return x, router, gate, up, down


@pytest.mark.parametrize("norm_topk", [True, False])
def test_ragged_experts_equal_the_dense_reference_values_and_gradients(norm_topk):
    def layer(fn, x, router, gate, up, down):
        r = route(x @ router, K, norm_topk=norm_topk)
        y = fn(x, r, gate, up, down, dtype=jnp.float32, precision="highest")
        return jnp.sum(jnp.sin(y)) + load_balancing_loss(balance_sums(r))

    args = _weights()
    want, want_g = jax.value_and_grad(lambda *a: layer(experts_dense, *a), argnums=range(5))(*args)
    got, got_g = jax.jit(jax.value_and_grad(lambda *a: layer(experts_ragged, *a),
                                            argnums=range(5)))(*args)
    # float32 sums of <= 32 products: a few ulps of values of size ~10
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name, g, w in zip(("x", "router", "gate", "up", "down"), got_g, want_g, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5, err_msg=name)
        assert np.abs(np.asarray(w)).max() > 1e-3, name  # every input gets a real gradient


def test_routing_is_softmax_top_k_with_optional_renormalisation():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]])
    p = np.exp(np.asarray(logits)) / np.exp(np.asarray(logits)).sum(-1, keepdims=True)
    r = route(logits, 2, norm_topk=False)
    np.testing.assert_array_equal(r.expert_RA, [[0, 1], [2, 3]])
    np.testing.assert_allclose(r.gate_RA, [[p[0, 0], p[0, 1]], [p[1, 2], p[1, 3]]], rtol=1e-6)
    r = route(logits, 2, norm_topk=True)
    np.testing.assert_allclose(r.gate_RA.sum(-1), [1.0, 1.0], rtol=1e-6)
    # DeepSeek-V3's bias changes which experts are chosen, not their (unbiased) weights
    biased = route(logits, 2, norm_topk=False, bias_E=jnp.array([0.0, 0.0, 0.0, 1.0]))
    np.testing.assert_array_equal(biased.expert_RA, [[3, 0], [3, 2]])
    np.testing.assert_allclose(biased.gate_RA[0], [p[0, 3], p[0, 0]], rtol=1e-6)


def _hf_load_balancing_loss(layer_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func (no attention mask), in numpy."""
    tokens, probs, rows = np.zeros(num_experts), np.zeros(num_experts), 0
    for logits in layer_logits:
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        selected = np.argsort(-w, axis=-1, kind="stable")[:, :top_k]
        tokens += np.bincount(selected.reshape(-1), minlength=num_experts)
        probs += w.sum(0)
        rows += w.shape[0]
    return float(np.sum((tokens / rows) * (probs / rows)) * num_experts)


def test_load_balancing_loss_pools_layers_as_transformers_does():
    layers = [np.asarray(jax.random.normal(jax.random.key(i), (T, E))) * (1 + i) for i in range(3)]
    sums = [balance_sums(route(jnp.asarray(g), K, norm_topk=True)) for g in layers]
    pooled = jax.tree.map(lambda *s: sum(s), *sums)
    np.testing.assert_allclose(load_balancing_loss(pooled),
                               _hf_load_balancing_loss(layers, E, K), rtol=1e-6)
    # even load and uniform probabilities: exactly K
    even = jnp.tile(jnp.eye(E) * 1e-3, (T // E, 1))  # each expert the best of T/E tokens
    r = route(even, 1, norm_topk=True)
    assert routing_stats(r)["max_over_mean_load"] == 1.0
    np.testing.assert_allclose(load_balancing_loss(balance_sums(r)), 1.0, rtol=1e-3)


def test_router_z_loss_is_the_mean_squared_log_partition():
    logits = jnp.array([[0.0, 0.0], [1.0, 3.0]])
    want = np.mean(np.log(np.exp(np.asarray(logits)).sum(-1)) ** 2)
    np.testing.assert_allclose(router_z_loss(logits), want, rtol=1e-6)
