"""A tiny float32 model, its batch, its loss and gradients on a mesh, and the parallel layouts
that must all match one device."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from titanax.config import Config, apply_overrides
from titanax.parallel.layer_order import to_logical_order
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import activation_spec, model_context
from titanax.train.optim import make_optimizer
from titanax.train.resolved import resolve
from titanax.train.state import create_train_state
from titanax.train.step import make_loss_fn

# 8 layers so that PP4 x 2 virtual stages has a chunk of one layer each; float32 throughout.
TINY = {"model.d_model": 32, "model.n_layers": 8, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.ffn_dim": 64, "model.vocab_size": 128, "model.max_seq_len": 64,
        "execution.dtype": "float32", "train.batch_size": 16, "train.seq_len": 16}


def tiny_config(**over) -> Config:
    return apply_overrides(Config(), {**TINY, **over})


def make_batch(cfg: Config) -> dict:
    rng = np.random.default_rng(0)
    B, S = cfg.train.batch_size, cfg.train.seq_len
    toks = rng.integers(0, cfg.model.vocab_size, (B, S + 1)).astype(np.int32)
    # Two packed documents per row, so segment masking and restarted positions are exercised.
    seg = np.repeat(np.array([1, 2], np.int32), S // 2)[None].repeat(B, 0)
    pos = np.concatenate([np.arange(S // 2), np.arange(S - S // 2)]).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg,
            "positions": np.tile(pos, (B, 1))}


def loss_and_grads(cfg: Config, devices):
    """Loss and gradients (layers in logical order) through the train step's own loss."""
    mesh = build_mesh(cfg.mesh, devices)
    graphdef, state, shardings = create_train_state(cfg, mesh, make_optimizer(cfg))
    batch_sharding = NamedSharding(mesh, activation_spec(("batch", "seq")))
    with model_context(mesh):
        fn = jax.jit(jax.value_and_grad(make_loss_fn(cfg, graphdef, resolve(cfg).spec)),
                     in_shardings=(shardings.weights, batch_sharding))
        jaxpr = str(jax.make_jaxpr(fn)(state.weights, make_batch(cfg)))
        loss, grads = fn(state.weights, make_batch(cfg))
    grads = jax.device_get(grads)
    grads["layers"] = to_logical_order(grads["layers"], mesh.shape["pipeline"],
                                       cfg.pipeline.resolved_virtual_stages)
    return float(loss), grads, jaxpr


def assert_matches(got, want):
    """(loss, grads) against one device's: loss to 1e-5 relative, every gradient to 1e-5 of
    its largest entry."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    for path, g, r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads),
                          jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(r))
        assert scale > 0
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * scale, err_msg=str(path[0]))


LAYOUTS = {
    "dp8": {"mesh.data": 8},
    "fsdp8": {"mesh.data": 1, "mesh.fsdp": 8},
    "tp2_fsdp4": {"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2},
    "tp2_dp2_pp2": {"mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2,
                    "pipeline.microbatches": 2, "mesh.nvlink_domain": 4},
    "pp4_gpipe": {"mesh.data": 2, "mesh.pipeline": 4, "pipeline.microbatches": 4},
    "pp4_circular": {"mesh.data": 2, "mesh.pipeline": 4, "pipeline.microbatches": 4,
                     "pipeline.schedule": "circular", "pipeline.virtual_stages": 2},
    # fewer microbatches than stages: the output is replicated, not scattered, before the loss
    "pp2_one_microbatch": {"mesh.data": 4, "mesh.pipeline": 2, "pipeline.microbatches": 1},
    # 1f1b: the loss runs on the last stage inside the schedule, gradients by its custom VJP
    "pp4_1f1b": {"mesh.data": 2, "mesh.pipeline": 4, "pipeline.microbatches": 8,
                 "pipeline.schedule": "1f1b"},
    "tp2_fsdp2_pp2_1f1b": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.tensor": 2,
                           "mesh.pipeline": 2, "pipeline.microbatches": 2,
                           "pipeline.schedule": "1f1b", "mesh.nvlink_domain": 4},
}
