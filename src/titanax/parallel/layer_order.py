"""The one place that knows circular pipelines store the layer stack out of logical order.

The circular (interleaved) schedule needs stage s's consecutive rows of the stacked [L, ...]
layer parameters to be the chunks it runs: stored chunk s*V + v is logical chunk v*PP + s
(parallel/pipeline.py). Every other layout stores the stack in logical order. Everything
outside this module sees logical order: train state creation stores through `to_stored`,
restoring under another layout goes through `reorder_restored`, and readers of a checkpoint
(sampling, HF export, HF import) map through `stored_position` / `to_logical`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def storage_permutation(n_layers: int, stages: int, virtual_stages: int) -> np.ndarray:
    """perm with stored[k] = logical[perm[k]]: stored chunk s*V + v is logical chunk v*PP + s,
    so stage s's consecutive rows are the chunks it runs. The identity for gpipe (V = 1)."""
    chunk = n_layers // (stages * virtual_stages)
    s, v = np.meshgrid(np.arange(stages), np.arange(virtual_stages), indexing="ij")
    logical_chunk = (v * stages + s).reshape(-1)  # indexed by stored chunk s*V + v
    return (logical_chunk[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1)


def stored_layer_order(cfg) -> np.ndarray | None:
    """For a run's Config (e.g. read from its checkpoint): perm with stored layer k = logical
    layer perm[k], or None when the stack is stored in logical order (all but circular PP)."""
    stages, virtual = cfg.mesh.pipeline, cfg.pipeline.resolved_virtual_stages
    if stages <= 1 or virtual == 1:
        return None
    return storage_permutation(cfg.model.n_layers, stages, virtual)


def stored_position(cfg) -> np.ndarray:
    """pos[l] = where logical layer l sits in the run's stored [L, ...] stack (identity unless
    circular PP). A checkpoint keeps its run's order; readers map through this."""
    perm = stored_layer_order(cfg)
    return np.arange(cfg.model.n_layers) if perm is None else np.argsort(perm)


def to_storage_order(layer_tree, stages: int, virtual_stages: int):
    """Logical layer order -> the stage-major order circular runs store (leading axis)."""
    if virtual_stages == 1 or stages == 1:
        return layer_tree
    leaves = jax.tree.leaves(layer_tree)
    perm = storage_permutation(leaves[0].shape[0], stages, virtual_stages)
    return jax.tree.map(lambda a: jnp.take(a, perm, axis=0), layer_tree)


def to_logical_order(layer_tree, stages: int, virtual_stages: int):
    """Inverse of to_storage_order: what a one-device model (or an export) expects."""
    if virtual_stages == 1 or stages == 1:
        return layer_tree
    leaves = jax.tree.leaves(layer_tree)
    inv = np.argsort(storage_permutation(leaves[0].shape[0], stages, virtual_stages))
    return jax.tree.map(lambda a: jnp.take(a, inv, axis=0), layer_tree)


def to_stored(layer_tree, cfg):
    """A run's layer stack in logical order -> the order `cfg`'s layout stores."""
    return to_storage_order(layer_tree, cfg.mesh.pipeline, cfg.pipeline.resolved_virtual_stages)


def to_logical_in_place(layers, run_cfg):
    """The layer stack of a run stored by `run_cfg`'s layout, in logical order, one leaf at a
    time, each original freed as its copy is made: never two copies of the stack."""
    order = stored_layer_order(run_cfg)
    if order is None:
        return layers
    inv = np.argsort(order)

    def move(a):
        out = jax.jit(lambda x: jnp.take(x, inv, axis=0), out_shardings=a.sharding)(a)
        a.delete()
        return out
    return jax.tree.map(move, layers)


def reorder_restored(state, shardings, saved_cfg, cfg):
    """A checkpoint restored under another pipeline layout gets its stacked leaves ('layers'
    in params and in the optimizer moments) put into this run's order, on device, keeping this
    run's shardings."""
    old, new = stored_layer_order(saved_cfg), stored_layer_order(cfg)
    if old is None and new is None or (old is not None and new is not None
                                       and np.array_equal(old, new)):
        return state
    n = cfg.model.n_layers
    to_logical = np.argsort(old) if old is not None else np.arange(n)
    take = to_logical[new] if new is not None else to_logical  # stored_new[k] = stored_old[take[k]]

    def reorder(path, x):
        if any(getattr(k, "key", None) == "layers" for k in path):
            # host-resident leaves (train.offload_*) are reordered on the device; the
            # out_shardings put them back
            if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
                x = jax.device_put(x, jax.memory.Space.Device)
            return x[take]
        return x

    return jax.jit(lambda st: jax.tree_util.tree_map_with_path(reorder, st),
                   out_shardings=shardings, donate_argnums=0)(state)
