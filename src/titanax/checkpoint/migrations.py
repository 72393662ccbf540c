"""Older checkpoint layouts read into the current one: what a step stores differently from the
train state this code builds, found from the step's metadata, and how its leaves are restored
and converted (checkpoint/manager.py restores through these; checkpoint/params_only.py and
checkpoint/reader.py too).

Parameter layout. Each step's metadata records PARAM_LAYOUT. Layout 2 stores wo as
[L, d, Hq, hd] and w_down as [L, d, F] (embed first, as HF does: FSDP then gathers each layer's
slice along its major axis). Steps without a recorded layout were written before and hold them
as [L, Hq, hd, d] and [L, F, d], the Adam moments alike; restoring such a step (and
checkpoint/reader.py, which export reads through) transposes those leaves into the current
layout, so every checkpoint a user has keeps working. Which leaves and how is the
architecture's to say (ModelSpec.legacy_transposes; Llama's in models/llama3/migrations.py).

State entries moved out of params (MOVED_OUT_OF_PARAMS). fp8_delayed's amax histories were
nnx.Params until issue 19: older steps hold them inside 'params' (params.layers.fp8_wq, ...)
and hold Adam moments for them in 'opt_state'. Restoring such a step into a state with an
'fp8' entry reads them from 'params' and moves them out, and never reads their moments
(a partial restore), so those checkpoints resume as they are.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from titanax.config import ModelConfig
from titanax.models.registry import model_spec

PARAM_LAYOUT = 2  # the parameter layout this code writes (see the module docstring)
LAYOUT_KEY = "titanax_param_layout"  # in each step's custom metadata

# Train-state entries that older checkpoints kept inside 'params', at the same paths below it
# (with optimizer moments of their own): see the module docstring.
MOVED_OUT_OF_PARAMS = ("fp8",)


def legacy_shape(shape, perm) -> tuple:
    """The old-layout shape (or spec) of a current-layout `shape`: the inverse of `perm`."""
    return tuple(shape[i] for i in np.argsort(perm))


def legacy_params(model: ModelConfig, stored_shapes: dict[str, tuple[int, ...]],
                  layout: int | None) -> dict[str, tuple[int, ...]]:
    """{name: perm} of the stacked parameters a checkpoint holds in an old layout (the
    architecture's spec lists them: ModelSpec.legacy_transposes, e.g.
    models/llama3/migrations.py). model: the checkpoint's own config (its dimensions give both
    layouts' shapes); stored_shapes: the stored shape of params.layers.<name>; layout: the
    step's recorded layout, None for steps written before layouts were recorded, which hold
    the old layout. Shapes alone cannot tell: with ffn_dim == d_model both w_down layouts have
    the same shape (and with n_heads == head_dim == d_model both wo layouts)."""
    if layout is not None and layout >= 2:
        return {}
    # The step's own spec (its config's model.arch), not the run's: the one lookup of the
    # checkpoint layer, which sits below train/resolved.py.
    candidates = model_spec(model).legacy_transposes(model)
    return {name: perm for name, (perm, current) in candidates.items()
            if stored_shapes.get(name) is not None
            and tuple(stored_shapes[name]) == legacy_shape(current, perm)}


def stored_legacy_params(model: ModelConfig, stored: dict,
                         layout: int | None) -> dict[str, tuple[int, ...]]:
    """legacy_params of a step written before PARAM_LAYOUT: model its config's, stored its
    'state' tree (stored_tree), layout its recorded one."""
    params = stored.get("params")
    layers = params.get("layers") if isinstance(params, dict) else None
    shapes = {}  # every stored stacked parameter's; legacy_params picks its candidates
    for name, leaf in (layers.items() if isinstance(layers, dict) else ()):
        leaf = leaf.get("value") if isinstance(leaf, dict) else leaf
        if getattr(leaf, "shape", None) is not None:
            shapes[name] = tuple(leaf.shape)
    return legacy_params(model, shapes, layout)


def stored_tree(state_dir: pathlib.Path) -> dict:
    """A step's stored 'state' tree (orbax metadata: shapes, no arrays read)."""
    meta = ocp.StandardCheckpointHandler().metadata(state_dir)
    tree = meta.tree if hasattr(meta, "tree") else meta
    return tree if isinstance(tree, dict) else {}


def _key_names(keypath) -> tuple[str, ...]:
    keys = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in keypath)
    return tuple(str(k) for k in keys if k != "value")


def _legacy_perm(keypath, legacy: dict) -> tuple[int, ...] | None:
    """The permutation for a train-state leaf of a legacy parameter (the parameter itself or
    an optimizer moment of it: any leaf at ...layers.<name>), else None."""
    names = _key_names(keypath)
    if len(names) >= 2 and names[-2] == "layers" and names[-1] in legacy:
        return legacy[names[-1]]
    return None


def legacy_abstract(abstract_state, legacy: dict):
    """abstract_state with the legacy leaves in their old shape, sharded by the permuted spec:
    each device restores exactly the data it keeps after the transpose."""
    def old(keypath, leaf):
        perm = _legacy_perm(keypath, legacy)
        if perm is None or len(getattr(leaf, "shape", ())) != len(perm):
            return leaf
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
            sharding = NamedSharding(sharding.mesh, P(*legacy_shape(spec, perm)),
                                     memory_kind=sharding.memory_kind)
        return jax.ShapeDtypeStruct(legacy_shape(leaf.shape, perm), leaf.dtype,
                                    sharding=sharding)
    return jax.tree_util.tree_map_with_path(old, abstract_state)


def _transposed(x, perm, sharding):
    """x.transpose(perm) on x's devices, placed by `sharding` (a leaf kept in host memory is
    transposed on the device and goes back). No data moves between devices."""
    def f(a):
        if getattr(jax.typeof(a), "memory_space", None) == jax.memory.Space.Host:
            a = jax.device_put(a, jax.memory.Space.Device)
        return jnp.transpose(a, perm)

    out = jax.jit(f, out_shardings=sharding)(x)
    x.delete()  # one old-layout leaf alive beside its transpose at a time
    return out


def to_current_layout(state, abstract_state, legacy: dict):
    """The restored state with its legacy leaves transposed into the current layout."""
    def convert(keypath, x, target):
        perm = _legacy_perm(keypath, legacy)
        if perm is None or getattr(x, "ndim", None) != len(perm):
            return x
        return _transposed(x, perm, getattr(target, "sharding", None))
    return jax.tree_util.tree_map_with_path(convert, state, abstract_state)


def moved_out_of_params(step_dir: pathlib.Path, abstract_state) -> tuple[str, ...]:
    """The MOVED_OUT_OF_PARAMS entries abstract_state has and the step at step_dir does not
    store apart: written before they left 'params' (into_params / out_of_params)."""
    wanted = [k for k in MOVED_OUT_OF_PARAMS if k in abstract_state]
    if not wanted:
        return ()
    stored = stored_tree(step_dir / "state")
    moved = tuple(k for k in wanted if k not in stored)
    for k in moved:
        for path, _ in nnx.to_flat_state(abstract_state[k]):
            node = stored.get("params")
            for key in path:
                node = node.get(key) if isinstance(node, dict) else None
            if node is None:
                raise ValueError(
                    f"checkpoint {step_dir} holds no '{k}' state (looked for "
                    f"{k}.{'.'.join(map(str, path))}, and at params.{'.'.join(map(str, path))} "
                    f"where older steps kept it): it was written by a run whose model has "
                    f"none (execution.matmul_precision other than fp8_delayed?); restore it "
                    f"with that run's model settings, or start the new model in a new "
                    f"--workdir")
    return moved


def into_params(abstract_state, moved):
    """abstract_state as an older step stores it: the `moved` entries' leaves inside 'params'."""
    out = {k: v for k, v in abstract_state.items() if k not in moved}
    out["params"] = nnx.merge_state(abstract_state["params"], *(abstract_state[k] for k in moved))
    return out


def out_of_params(state, abstract_state, moved):
    """A state restored through into_params(abstract_state, moved) in the current form: the
    `moved` entries' leaves taken out of 'params' (found by the paths abstract_state gives
    them)."""
    state, params = dict(state), state["params"]
    for k in moved:
        paths = {path for path, _ in nnx.to_flat_state(abstract_state[k])}
        state[k], params = nnx.split_state(params, lambda path, _: tuple(path) in paths, ...)
    state["params"] = params
    return state
