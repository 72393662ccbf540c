"""Checkpoints carried across layouts: save a train state under one config's mesh, restore it
under the next one's, and check that nothing changed but the sharding."""

from __future__ import annotations

import jax

from tests.helpers.small import tree_equal
from titanax.checkpoint.manager import Checkpointer
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import model_context
from titanax.train.optim import make_optimizer
from titanax.train.state import TrainState, abstract_train_state, create_train_state


def restore_through(tmp_path, cfgs):
    """Yields (config, restored state) for cfgs[1:]: the state of cfgs[0], created fresh,
    saved under each config and restored under the next, asserted equal in value (params and
    optimizer state) with every leaf in the new layout's sharding."""
    _, state, _ = create_train_state(cfgs[0], build_mesh(cfgs[0].mesh), make_optimizer(cfgs[0]))
    for step, (old, new) in enumerate(zip(cfgs, cfgs[1:]), start=1):
        ckpt = Checkpointer(tmp_path / str(step), old.checkpoint)
        ckpt.save(step, state.to_saved(), data_state=None, config=old.to_dict())
        ckpt.close()
        mesh = build_mesh(new.mesh)
        _, abstract, shardings = abstract_train_state(new, mesh, make_optimizer(new))
        with model_context(mesh):
            got = Checkpointer(tmp_path / str(step), new.checkpoint).restore_latest_good(
                abstract.to_saved(), cfg=new)
        restored = TrainState.from_saved(got.state)
        assert tree_equal(restored.weights, state.weights)
        assert tree_equal(restored.opt_state, state.opt_state)
        specs = [leaf.sharding.spec for leaf in jax.tree.leaves(restored)]
        assert specs == [want.spec for want in jax.tree.leaves(shardings)]
        yield new, restored
        state = restored
