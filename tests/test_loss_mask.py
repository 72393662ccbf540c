"""Targets that bear no loss (ops.IGNORE_INDEX, -100 as in transformers' labels): they add
nothing to the loss and get no gradient, and the train step's loss is the mean over the
loss-bearing targets of the whole step, whatever train.grad_accum and the parallel layout
(issue 33: fine-tuning on responses only). Float32, 8 simulated CPU devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from tests.helpers.layouts import make_batch, tiny_config
from titanax.ops import IGNORE_INDEX
from titanax.ops.cross_entropy import dense_cross_entropy_sum, linear_cross_entropy_sum
from titanax.parallel.layer_order import to_logical_order
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import activation_spec, model_context
from titanax.train import step as train_step
from titanax.train.optim import make_optimizer
from titanax.train.resolved import resolve
from titanax.train.state import create_train_state

pytestmark = pytest.mark.usefixtures("devices8")


def _mask(targets, seed=1):
    """About half the targets ignored, a whole row among them (a prompt-only example), and
    rows with different counts, so a mean of per-microbatch means would be wrong."""
    rng = np.random.default_rng(seed)
    keep = rng.random(targets.shape) < np.linspace(0.2, 0.9, targets.shape[0])[:, None]
    keep[len(keep) // 2] = False
    return np.where(keep, targets, IGNORE_INDEX).astype(np.int32)


def test_ignored_targets_add_nothing_and_get_no_gradient():
    rng = np.random.default_rng(0)
    B, S, D, V = 4, 16, 8, 32
    h = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(D, V)) * 0.5, jnp.float32)
    targets = _mask(rng.integers(0, V, (B, S)))
    keep = targets != IGNORE_INDEX

    def by_hand(h, w):  # the kept tokens' nll, nothing else
        logits = jnp.einsum("bsd,dv->bsv", h, w, precision="highest")
        nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(
            logits, np.where(keep, targets, 0)[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(keep, nll, 0.0))

    want, want_g = jax.value_and_grad(by_hand, (0, 1))(h, w)
    for fn in (lambda h, w: dense_cross_entropy_sum(h, w, targets, precision="highest"),
               lambda h, w: linear_cross_entropy_sum(h, w, targets, chunk=4,
                                                     precision="highest")):
        got, got_g = jax.value_and_grad(fn, (0, 1))(h, w)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        for g, r in zip(got_g, want_g):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    # an ignored position's hidden state gets no gradient at all
    assert not np.any(np.asarray(got_g[0])[~keep])
    # a target outside the vocabulary (not the ignore index) is still broken data: NaN
    bad = targets.copy()
    bad[0, 0] = -7
    assert np.isnan(linear_cross_entropy_sum(h, w, bad, chunk=4))


def _step_loss_and_grads(cfg, devices, batch):
    """The train step's loss and gradients (train/step.py _grads: microbatches and all)."""
    mesh = build_mesh(cfg.mesh, devices)
    graphdef, state, shardings = create_train_state(cfg, mesh, make_optimizer(cfg))
    loss_fn = train_step.make_loss_fn(cfg, graphdef, resolve(cfg).spec, with_metrics=True)
    batch_sharding = NamedSharding(mesh, activation_spec(("batch", "seq")))
    with model_context(mesh):
        fn = jax.jit(lambda p, b: train_step._grads(cfg, loss_fn, p, nnx.State({}), b)[:2],
                     in_shardings=(shardings.weights, batch_sharding))
        loss, grads = fn(state.weights, batch)
        model = nnx.merge(graphdef, state.weights)
        logits, _ = jax.jit(lambda t, p, s: model(t, p, s))(
            batch["inputs"], batch["positions"], batch["segment_ids"])
    grads = jax.device_get(grads)
    grads["layers"] = to_logical_order(grads["layers"], mesh.shape["pipeline"],
                                       cfg.pipeline.resolved_virtual_stages)
    return float(loss), grads, np.asarray(logits, np.float64)


LAYOUTS = {
    "one device, grad_accum 1": ({}, 1),
    "one device, grad_accum 4 (in place)": ({"train.grad_accum": 4, "execution.remat": "full"}, 1),
    "one device, grad_accum 4 (plain sum)": ({"train.grad_accum": 4}, 1),
    "fsdp 2 x tensor 2, grad_accum 2": ({"mesh.fsdp": 2, "mesh.tensor": 2,
                                         "train.grad_accum": 2, "execution.remat": "full"}, 4),
}


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_config(**{"mesh.data": 1, "model.n_layers": 2})
    batch = make_batch(cfg)
    batch["targets"] = _mask(batch["targets"])
    loss, grads, logits = _step_loss_and_grads(cfg, jax.devices()[:1], batch)
    return cfg, batch, loss, grads, logits


def test_step_loss_is_the_mean_over_the_loss_bearing_tokens(reference):
    """As transformers computes it with labels=-100: the summed nll of the kept targets over
    their count (here from the model's own logits, in float64)."""
    _, batch, loss, _, logits = reference
    t = batch["targets"]
    keep = t != IGNORE_INDEX
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    nll = lse - np.take_along_axis(logits, np.where(keep, t, 0)[..., None], -1)[..., 0]
    want = nll[keep].sum() / keep.sum()
    assert 0 < keep.sum() < keep.size
    assert loss == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "one device, grad_accum 1"])
def test_grad_accum_and_layouts_keep_the_masked_mean(reference, name):
    cfg, batch, loss, grads, _ = reference
    over, n_devices = LAYOUTS[name]
    from titanax.config import apply_overrides

    got_loss, got_grads, _ = _step_loss_and_grads(apply_overrides(cfg, over),
                                                  jax.devices()[:n_devices], batch)
    assert got_loss == pytest.approx(loss, rel=1e-5)
    for g, r in zip(jax.tree.leaves(got_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * np.max(np.abs(r)))
