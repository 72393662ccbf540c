"""The typed train state (issue 55, train/state.py): each variable type's role, the optimizer
state over exactly the trained role's leaves, statistics outside it and outside the gradient
norm, the on-disk dict layout unchanged (to_saved / from_saved, and a checkpoint written as the
code before TrainState wrote it restores), and the batch rule's one statement."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from tests.helpers.layouts import make_batch, tiny_config
from tests.helpers.small import tree_equal
from titanax.checkpoint.manager import Checkpointer
from titanax.config import ConfigError
from titanax.models.common.lora import LoRA
from titanax.ops.linear import Fp8Meta
from titanax.parallel.mesh import build_mesh, check_layout
from titanax.parallel.rules import model_context
from titanax.train import step as train_step
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.resolved import resolve
from titanax.train.state import (
    Role,
    TrainState,
    create_train_state,
    jit_train_step,
    roles_for,
    state_layout,
    trainable_count,
)

SMALL = {"model.n_layers": 2, "optim.warmup_steps": 1}
LORA = {**SMALL, "lora.rank": 4, "lora.alpha": 8.0}
FP8 = {**SMALL, "execution.matmul_precision": "fp8_delayed", "execution.fp8_amax_history": 4}
MOE_BIAS = {**SMALL, "model.arch": "mixtral", "model.n_experts": 4,
            "model.experts_per_token": 2, "model.router_bias_update_rate": 1e-3,
            "model.rope_scaling": "none"}


def _layout(**over):
    cfg = tiny_config(**over)
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    tx = make_optimizer(cfg)
    return cfg, mesh, tx, state_layout(cfg, mesh, tx)


def _adam(opt_state):
    return jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu"))[0]


def _types(tree) -> set[type]:
    return {type(v) for v in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))}


def test_the_role_table():
    table = lambda cfg: roles_for(cfg, resolve(cfg).spec)  # noqa: E731
    plain, lora = table(tiny_config(**SMALL)), table(tiny_config(**LORA))
    assert dict(plain.by_type) == {nnx.Param: Role.TRAINED, LoRA: Role.ADAPTER,
                                   Fp8Meta: Role.STATISTIC}
    assert plain.trains is Role.TRAINED and plain.self_updated is None
    assert dict(lora.by_type)[nnx.Param] is Role.FROZEN and lora.trains is Role.ADAPTER
    moe = table(tiny_config(**MOE_BIAS))
    assert moe.self_updated.selects(("layers", "router_bias"))
    assert not moe.self_updated.selects(("layers", "router"))


@pytest.mark.parametrize("over, roles, on_disk", [
    (SMALL, {Role.TRAINED}, {"step", "params", "opt_state"}),
    (LORA, {Role.FROZEN, Role.ADAPTER}, {"step", "params", "lora", "opt_state"}),
    (FP8, {Role.TRAINED, Role.STATISTIC}, {"step", "params", "fp8", "opt_state"}),
])
def test_groups_by_role_and_the_optimizer_covers_exactly_the_trained_role(over, roles, on_disk):
    _, _, _, layout = _layout(**over)
    state = layout.abstract
    assert set(state.variables) == roles
    trained = state.trained
    # The moments mirror the trained role's variables, nothing else (no base, no histories).
    adam = _adam(state.opt_state)
    assert jax.tree.structure(adam.mu) == jax.tree.structure(trained)
    assert jax.tree.structure(adam.nu) == jax.tree.structure(trained)
    if Role.FROZEN in roles:  # LoRA: the adapters alone
        assert _types(trained) == {LoRA} and _types(state.weights) == {nnx.Param}
        n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state))
        assert n_opt < sum(x.size for x in jax.tree.leaves(state.weights))
    if Role.STATISTIC in roles:
        assert _types(state.statistics) == {Fp8Meta} and _types(trained) == {nnx.Param}
    # The on-disk layout: the dict the checkpoints have always held, leaves in the same order
    # (the compiled step's parameters are the dict's were).
    saved = state.to_saved()
    assert set(saved) == on_disk
    assert jax.tree.structure(layout.shardings) == jax.tree.structure(
        jax.tree.map(lambda a: a.sharding, state))
    assert [x.shape for x in jax.tree.leaves(state)] == [x.shape for x in jax.tree.leaves(saved)]
    back = TrainState.from_saved(saved, layout.roles)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert TrainState.from_saved(saved).variables.keys() == state.variables.keys()  # inferred


def test_fp8_histories_update_by_their_rule_outside_the_optimizer_and_the_norm():
    """One fp8_delayed step: its grad_norm is the weights' gradient norm alone (the histories'
    "gradients", their new values, are not in it), the histories move by their rule (the
    step's amaxes recorded), and the moments are those of the weights."""
    cfg, mesh, tx, layout = _layout(**FP8)
    graphdef, state, shardings = create_train_state(cfg, mesh, tx)
    batch = make_batch(cfg)
    loss_fn = train_step.make_loss_fn(cfg, graphdef, resolve(cfg).spec, with_metrics=True)
    with model_context(mesh):
        _, grads, new_fp8, _ = jax.jit(lambda p, f, b: train_step._grads(cfg, loss_fn, p, f, b))(
            state.trained, state.statistics, batch)
        step = jit_train_step(cfg, mesh, graphdef, shardings, tx, lr_schedule(cfg))
        new, metrics = step(state, batch)
    assert float(metrics["grad_norm"]) == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)
    with_histories = float(optax.tree.norm((grads, new_fp8)))
    assert with_histories > 1.5 * float(metrics["grad_norm"])  # it would show
    assert tree_equal(new.statistics, new_fp8)  # set by the rule, not by the optimizer
    hist = np.asarray(new.statistics["layers"]["fp8_wq"][...])
    assert np.all(hist[..., 0] > 0) and not np.any(hist[..., 1:])
    assert jax.tree.structure(_adam(new.opt_state).mu) == jax.tree.structure(new.weights)
    assert int(new.step) == 1


def test_trainable_count_leaves_out_the_routing_bias():
    cfg, _, _, layout = _layout(**MOE_BIAS)
    total = sum(x.size for x in jax.tree.leaves(layout.abstract.trained))
    bias = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(layout.abstract.trained)
               if "router_bias" in jax.tree_util.keystr(p))
    assert bias > 0 and trainable_count(layout.abstract, layout.roles) == total - bias
    _, _, _, lora = _layout(**LORA)
    assert trainable_count(lora.abstract, lora.roles) == sum(
        x.size for x in jax.tree.leaves(lora.abstract.adapters))


@pytest.mark.parametrize("over", [SMALL, LORA, FP8, MOE_BIAS],
                         ids=["plain", "lora", "fp8_delayed", "moe_bias"])
def test_a_checkpoint_in_the_dict_layout_restores(tmp_path, over):
    """A step written as the code before TrainState wrote it (the dict with string keys, built
    by hand here) restores into the typed state, value for value; to_saved() writes the same
    tree (orbax's metadata: the same entries and shapes)."""
    cfg, mesh, tx, layout = _layout(**over, **{"checkpoint.async_save": False})
    _, state, _ = create_train_state(cfg, mesh, tx)
    old = {"step": state.step, "params": state.weights, "opt_state": state.opt_state}
    if state.adapters is not None:
        old["lora"] = state.adapters
    if state.statistics is not None:
        old["fp8"] = state.statistics
    ckpt = Checkpointer(tmp_path / "old", cfg.checkpoint)
    ckpt.save(3, old, data_state=None, config=cfg.to_dict())
    new = Checkpointer(tmp_path / "new", cfg.checkpoint)
    new.save(3, state.to_saved(), data_state=None, config=cfg.to_dict())
    shapes = lambda tree: jax.tree.map(lambda m: tuple(m.shape), tree)  # noqa: E731
    assert shapes(ckpt._state_tree(3)) == shapes(new._state_tree(3))
    new.close()
    with model_context(mesh):
        saved, _, _ = ckpt.restore(3, layout.abstract.to_saved())
    ckpt.close()
    got = TrainState.from_saved(saved, layout.roles)
    assert got.variables.keys() == state.variables.keys()
    assert tree_equal(got, state)
    for leaf, want in zip(jax.tree.leaves(got), jax.tree.leaves(layout.shardings), strict=True):
        assert leaf.sharding == want


@pytest.mark.usefixtures("devices8")
def test_the_batch_rule_is_expert_x_data_x_fsdp():
    """The Trainer's check is check_layout's (config/rules.py): the rows split over
    expert x data x fsdp, not data x fsdp alone."""
    # fsdp=-1: the config cannot check the split, the mesh's resolved degrees can
    over = {**MOE_BIAS, "model.router_bias_update_rate": 0.0, "mesh.data": 1,
            "mesh.fsdp": -1, "mesh.expert": 2}
    ok = tiny_config(**over, **{"train.batch_size": 8})
    check_layout(ok, build_mesh(ok.mesh, devices=jax.devices()[:4]))
    bad = tiny_config(**over, **{"train.batch_size": 6})  # divides by data x fsdp = 2
    with pytest.raises(ConfigError, match="expert = 4"):
        check_layout(bad, build_mesh(bad.mesh, devices=jax.devices()[:4]))
