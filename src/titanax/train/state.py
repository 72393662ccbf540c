"""Sharded train state, created on device: the init function is jitted with out_shardings from
the parameters' logical axes, so no host ever holds the full weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from titanax.config import Config
from titanax.models.llama import Llama
from titanax.parallel.rules import model_context


def _state_shardings(abstract_state, mesh):
    """NamedShardings for a state pytree whose Variables carry logical names (params, and the
    optimizer moments that mirror them); everything else (step, counters) is replicated."""
    specs = nnx.get_partition_spec(abstract_state)
    return jax.tree.map(lambda s: NamedSharding(mesh, s if isinstance(s, P) else P()), specs,
                        is_leaf=lambda x: isinstance(x, P) or x is None)


def _make_init(cfg: Config, tx: optax.GradientTransformation):
    box = {}

    def init():
        model = Llama(cfg.model, rngs=nnx.Rngs(params=cfg.train.seed))
        graphdef, params = nnx.split(model, nnx.Param)
        box["graphdef"] = graphdef
        return {"step": jnp.zeros((), jnp.int32), "params": params,
                "opt_state": tx.init(params)}

    return init, box


def abstract_train_state(cfg: Config, mesh, tx):
    """(graphdef, abstract state with shardings, shardings) without allocating anything."""
    init, box = _make_init(cfg, tx)
    with model_context(mesh):
        abstract = jax.eval_shape(init)
        shardings = _state_shardings(abstract, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    return box["graphdef"], abstract, shardings


def create_train_state(cfg: Config, mesh, tx):
    """(graphdef, state, shardings); state = {'step', 'params', 'opt_state'}, on device."""
    graphdef, _, shardings = abstract_train_state(cfg, mesh, tx)
    init, _ = _make_init(cfg, tx)
    with model_context(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state, shardings
