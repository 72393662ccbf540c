"""Meshes and layouts on 8 simulated CPU devices: every parallel layout computes the same loss
and gradients as one device, FSDP shrinks per-device memory, bad layouts fail clearly."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from titanax.config import Config, ConfigError, MeshConfig, apply_overrides
from titanax.parallel.layer_order import to_logical_order
from titanax.parallel.mesh import build_mesh, describe_mesh
from titanax.parallel.rules import activation_spec, model_context
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.state import abstract_train_state, create_train_state, jit_train_step
from titanax.train.step import make_loss_fn

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

# 8 layers so that PP4 x 2 virtual stages has a chunk of one layer each; float32 throughout.
TINY = {"model.d_model": 32, "model.n_layers": 8, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.ffn_dim": 64, "model.vocab_size": 128, "model.max_seq_len": 64,
        "model.dtype": "float32", "train.batch_size": 16, "train.seq_len": 16}


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
        fn = jax.jit(jax.value_and_grad(make_loss_fn(cfg, graphdef)),
                     in_shardings=(shardings["params"], batch_sharding))
        jaxpr = str(jax.make_jaxpr(fn)(state["params"], make_batch(cfg)))
        loss, grads = fn(state["params"], make_batch(cfg))
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


@pytest.fixture(scope="module")
def one_device():
    return loss_and_grads(tiny_config(**{"mesh.data": 1}), jax.devices()[:1])


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


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_device(name, one_device):
    ref_loss, ref_grads, _ = one_device
    loss, grads, jaxpr = loss_and_grads(tiny_config(**LAYOUTS[name]), jax.devices())
    assert_matches((loss, grads), (ref_loss, ref_grads))
    # The pipelined layouts really are staged with ppermute, the others are not.
    assert ("ppermute" in jaxpr) == ("mesh.pipeline" in LAYOUTS[name])


def test_fsdp_shrinks_per_device_argument_memory():
    sizes = {}
    for fsdp in (1, 2, 4, 8):
        cfg = tiny_config(**{"mesh.data": -1, "mesh.fsdp": fsdp, "model.d_model": 64,
                             "model.n_layers": 2, "model.ffn_dim": 256,
                             "model.vocab_size": 512})
        mesh = build_mesh(cfg.mesh)
        tx = make_optimizer(cfg)
        graphdef, abstract, shardings = abstract_train_state(cfg, mesh, tx)
        batch_sharding = NamedSharding(mesh, activation_spec(("batch", "seq")))
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
                 for k, v in make_batch(cfg).items()}
        with model_context(mesh):
            step = jit_train_step(cfg, mesh, graphdef, shardings, tx, lr_schedule(cfg))
            compiled = step.lower(abstract, batch).compile()
        sizes[fsdp] = compiled.memory_analysis().argument_size_in_bytes
    # Parameters and both Adam moments are split fsdp ways (norm scales stay replicated).
    assert sizes[2] < 0.55 * sizes[1] and sizes[4] < 0.55 * sizes[2] and sizes[8] < 0.6 * sizes[4], sizes


def test_mesh_keeps_tensor_in_a_domain_and_crosses_domains_on_rails():
    mesh = build_mesh(MeshConfig(data=2, tensor=2, pipeline=2, nvlink_domain=4))
    ids = np.vectorize(lambda d: d.id)(mesh.devices)  # [pipeline, data, fsdp, tensor]
    domain, rank = ids // 4, ids % 4
    assert (domain == domain[..., :1]).all()  # a tensor group never leaves its domain
    assert (domain == domain[:, :1]).all()  # data fits in a domain here: kept inside
    assert (domain[0] != domain[1]).all()  # pipeline crosses domains...
    assert (rank[0] == rank[1]).all()  # ...between devices of the same local rank (one rail)
    text = describe_mesh(mesh)
    assert "2 NVLink domain(s) of 4" in text and "domain 1: devices [4, 5, 6, 7]" in text
    assert "across domains (InfiniBand, rail-aligned): pipeline=2" in text
    assert "[0, 4], [1, 5], [2, 6], [3, 7]" in text


def test_fsdp_overflows_across_domains():
    mesh = build_mesh(MeshConfig(data=1, fsdp=8, nvlink_domain=4))
    ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1)
    assert ids.tolist() == list(range(8))  # inner fsdp=4 in each domain, outer 2 across
    assert "across domains (InfiniBand, rail-aligned): fsdp=2" in describe_mesh(mesh)


BAD = [
    ({"mesh.data": 3, "train.batch_size": 24}, "multiply to 3 but there are 8 devices"),
    ({"mesh.data": 1, "mesh.tensor": 8, "mesh.nvlink_domain": 4, "model.n_heads": 8,
      "model.n_kv_heads": 8}, "mesh.tensor=8 must divide the NVLink domain of 4"),
    ({"mesh.tensor": 8, "model.n_kv_heads": 4, "model.n_heads": 4}, "model.n_heads: 4 is not divisible by mesh.tensor=8"),
    ({"mesh.tensor": 4}, "model.n_kv_heads: 2 is not divisible by mesh.tensor=4"),
    ({"mesh.pipeline": 4, "model.n_layers": 6}, "6 layers do not split into mesh.pipeline=4"),
    ({"mesh.pipeline": 4, "pipeline.schedule": "circular", "pipeline.microbatches": 4,
      "model.n_layers": 4}, "virtual_stages=2 equal chunks"),
    ({"mesh.data": 1, "mesh.fsdp": 8, "train.batch_size": 12}, "do not split over mesh data x fsdp = 8"),
    ({"mesh.data": 2, "mesh.pipeline": 4, "pipeline.microbatches": 16}, "do not split over mesh data x fsdp = 2"),
    ({"mesh.pipeline": 2, "pipeline.microbatches": 3}, "pipeline.microbatches: 3 does not divide"),
    ({"mesh.pipeline": 4, "pipeline.schedule": "circular", "pipeline.microbatches": 2},
     "needs at least as many microbatches as stages"),
    ({"pipeline.schedule": "gpipe", "pipeline.virtual_stages": 2}, "needs pipeline.schedule=circular"),
    ({"mesh.data": 1, "mesh.tensor": -1}, "model.n_heads: 4 is not divisible by mesh.tensor=8"),
]


@pytest.mark.parametrize("over,message", BAD, ids=[m for _, m in BAD])
def test_bad_layout_fails_with_its_message(over, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        cfg = tiny_config(**over)  # device-independent checks fail here...
        mesh = build_mesh(cfg.mesh)  # ...degrees against devices and domains here...
        abstract_train_state(cfg, mesh, make_optimizer(cfg))  # ...resolved -1 degrees here
