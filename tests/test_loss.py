"""The fused, chunked output layer + cross-entropy (ops/cross_entropy.py) against the dense
reference: same loss and gradients, with no [B, S, V] float32 tensor in the compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax.config import (
    Config,
    ExecutionConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
    apply_overrides,
)
from titanax.ops.cross_entropy import (
    chunk_positions,
    dense_cross_entropy_sum,
    linear_cross_entropy_sum,
)
from titanax.train.resolved import resolve

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

B, S, D, V = 2, 32, 16, 96


def _inputs(dtype=jnp.float32):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    h = jax.random.normal(k[0], (B, S, D), dtype)
    w = (jax.random.normal(k[1], (D, V)) * 0.3).astype(dtype)
    t = jax.random.randint(k[2], (B, S), 0, V)
    return h, w, t


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


@pytest.mark.parametrize("chunk", [S, 8, 1])
def test_chunked_loss_and_gradients_equal_the_dense_ones(chunk):
    h, w, t = _inputs()
    dense = jax.value_and_grad(lambda h, w: dense_cross_entropy_sum(h, w, t), argnums=(0, 1))
    fused = jax.value_and_grad(lambda h, w: linear_cross_entropy_sum(h, w, t, chunk=chunk),
                               argnums=(0, 1))
    (v0, (dh0, dw0)), (v1, (dh1, dw1)) = dense(h, w), fused(h, w)
    np.testing.assert_allclose(v1, v0, rtol=1e-6)
    assert _rel(dh1, dh0) < 1e-6 and _rel(dw1, dw0) < 1e-6
    # called without differentiation (evaluation): the loss alone
    np.testing.assert_allclose(linear_cross_entropy_sum(h, w, t, chunk=chunk), v0, rtol=1e-6)


def test_cotangent_scales_the_gradients():
    """The backward multiplies the forward's gradients by the incoming cotangent (a mean loss
    divides by the token count; grad accumulation scales again)."""
    h, w, t = _inputs()
    g0 = jax.grad(lambda h: 0.25 * dense_cross_entropy_sum(h, w, t))(h)
    g1 = jax.grad(lambda h: 0.25 * linear_cross_entropy_sum(h, w, t, chunk=4))(h)
    assert _rel(g1, g0) < 1e-6


def test_bf16_operands_match_the_dense_bf16_path():
    h, w, t = _inputs(jnp.bfloat16)
    dense = jax.grad(lambda h, w: dense_cross_entropy_sum(h, w, t), argnums=(0, 1))(h, w)
    fused = jax.grad(lambda h, w: linear_cross_entropy_sum(h, w, t, chunk=8), argnums=(0, 1))(h, w)
    for a, b in zip(fused, dense):
        assert a.dtype == jnp.bfloat16
        assert _rel(a.astype(jnp.float32), b.astype(jnp.float32)) < 2e-2


def test_out_of_vocabulary_target_gives_nan():
    """Broken data must reach the train step's non-finite guard, not vanish into the loss."""
    h, w, t = _inputs()
    t = t.at[1, 3].set(V)
    assert not np.isfinite(float(linear_cross_entropy_sum(h, w, t, chunk=8)))
    val, grads = jax.value_and_grad(
        lambda h, w: linear_cross_entropy_sum(h, w, t, chunk=8), argnums=(0, 1))(h, w)
    assert not np.isfinite(float(val))


def test_chunk_positions():
    assert chunk_positions(8192, 4, 4096) == 1024  # 4 rows x 1024 positions
    assert chunk_positions(8192, 2, 0) == 8192  # 0: no chunking
    assert chunk_positions(100, 1, 64) == 50  # the largest divisor of S that fits
    assert chunk_positions(7, 16, 4) == 1  # never below one position
    with pytest.raises(ValueError, match="divisor"):
        linear_cross_entropy_sum(*_inputs(), chunk=5)


def _step_cfg(**train) -> Config:
    model = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_dim=64, max_seq_len=64)
    return Config(model=model, execution=ExecutionConfig(dtype="float32"),
                  mesh=MeshConfig(data=1), train=TrainConfig(batch_size=4, seq_len=64, **train))


def _loss_and_grads(cfg: Config, devices, accum: bool = False, spec=None):
    """(loss, gradients, compiled HLO, parameters) of make_loss_fn on a fixed batch; accum: through the
    train step's microbatch sum (train.grad_accum) instead. spec: the model's (default cfg's)."""
    from flax import nnx

    from titanax.parallel.mesh import build_mesh
    from titanax.parallel.rules import model_context
    from titanax.train.optim import make_optimizer
    from titanax.train.state import create_train_state
    from titanax.train.step import _grads, make_loss_fn

    mesh = build_mesh(cfg.mesh, devices)
    spec = spec or resolve(cfg).spec
    graphdef, state, _ = create_train_state(cfg, mesh, make_optimizer(cfg))
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.model.vocab_size, (4, 65), dtype=np.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
             "segment_ids": np.ones((4, 64), np.int32),
             "positions": np.broadcast_to(np.arange(64, dtype=np.int32), (4, 64)).copy()}
    with model_context(mesh):
        fn = jax.jit(jax.value_and_grad(make_loss_fn(cfg, graphdef, spec)))
        if accum:
            loss_fn = make_loss_fn(cfg, graphdef, spec, with_metrics=True)
            fn = jax.jit(lambda p, b: _grads(cfg, loss_fn, p, None, b)[:2])
        loss, grads = fn(state.weights, batch)
        hlo = fn.lower(state.weights, batch).compile().as_text()
    pure = lambda t: nnx.to_pure_dict(jax.tree.map(np.asarray, t))  # noqa: E731
    return float(loss), pure(grads), hlo, pure(state.weights)


def test_train_step_loss_is_chunked_and_equals_one_chunk():
    """The model's loss with 4 chunks equals one chunk (what the dense path computed) to 1e-6,
    gradients included, and the compiled 4-chunk step holds no [B, S, V] float32 buffer."""
    one, g_one, _, _ = _loss_and_grads(_step_cfg(loss_chunk=0), jax.devices()[:1])
    four, g_four, hlo, _ = _loss_and_grads(_step_cfg(loss_chunk=64), jax.devices()[:1])  # 16 pos.
    np.testing.assert_allclose(four, one, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g_four), jax.tree.leaves(g_one)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert "f32[4,64,512]" not in hlo and "f32[4,16,512]" in hlo


def test_sharded_loss_matches_one_device():
    """fsdp 2 x tensor 2 x data 2 (vocab split over tensor, weight gathered over fsdp) gives the
    single-device loss and gradients."""
    base = _step_cfg(loss_chunk=64)
    one, g_one, _, _ = _loss_and_grads(base, jax.devices()[:1])
    cfg = apply_overrides(base, {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    eight, g_eight, _, _ = _loss_and_grads(cfg, jax.devices()[:8])
    np.testing.assert_allclose(eight, one, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_eight), jax.tree.leaves(g_one)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_an_architectures_aux_losses_join_the_step_loss_and_gradients():
    """ModelSpec.aux_losses: its terms (here 1e-3 x the embedding's squared norm) add to the
    step's mean loss and their gradients to the parameters', and split over microbatches
    (train.grad_accum=2) they still sum to one term."""
    import dataclasses

    base_cfg = _step_cfg(loss_chunk=0)
    dense, g_dense, _, params = _loss_and_grads(base_cfg, jax.devices()[:1])
    l2 = lambda m: {"l2": 1e-3 * jnp.sum(jnp.square(m.embed[...]))}  # noqa: E731
    spec = dataclasses.replace(resolve(base_cfg).spec, aux_losses=l2)
    with_aux, g_aux, _, _ = _loss_and_grads(base_cfg, jax.devices()[:1], spec=spec)
    # (the same initial weights: create_train_state is seeded by train.seed)
    embed = params["embed"]
    np.testing.assert_allclose(with_aux - dense, 1e-3 * np.sum(np.square(embed)), rtol=1e-4)
    np.testing.assert_allclose(g_aux["embed"] - g_dense["embed"], 2e-3 * embed, rtol=1e-3,
                               atol=1e-8)
    np.testing.assert_array_equal(g_aux["output"], g_dense["output"])
    accum2, g_accum2, _, _ = _loss_and_grads(_step_cfg(loss_chunk=0, grad_accum=2),
                                          jax.devices()[:1], accum=True, spec=spec)
    np.testing.assert_allclose(accum2, with_aux, rtol=1e-5)
    np.testing.assert_allclose(g_accum2["embed"], g_aux["embed"], rtol=1e-4, atol=1e-7)
