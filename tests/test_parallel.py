"""Meshes and layouts on 8 simulated CPU devices: every parallel layout computes the same loss
and gradients as one device, FSDP shrinks per-device memory, bad layouts fail clearly."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from tests.helpers.layouts import LAYOUTS, assert_matches, loss_and_grads, make_batch, tiny_config
from titanax.config import ConfigError, MeshConfig
from titanax.parallel.mesh import build_mesh, describe_mesh
from titanax.parallel.rules import activation_spec, model_context
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.state import abstract_train_state, jit_train_step

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices











@pytest.fixture(scope="module")
def one_device():
    return loss_and_grads(tiny_config(**{"mesh.data": 1}), jax.devices()[:1])




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
