"""Sharded train state, created on device: the init function is jitted with out_shardings from
the parameters' logical axes, so no host ever holds the full weights. Circular pipeline runs
store the layer stack stage-major (parallel/pipeline.py); the permutation happens here, once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from titanax.config import Config
from titanax.models.common.lora import LoRA
from titanax.models.registry import model_spec
from titanax.ops.linear import Fp8Meta
from titanax.parallel.layer_order import to_storage_order
from titanax.parallel.mesh import check_layout
from titanax.parallel.rules import batch_input_spec, model_context
from titanax.train import offload


def _state_shardings(abstract_state, mesh):
    """NamedShardings for a state pytree whose Variables carry logical names (params, and the
    optimizer moments that mirror them); everything else (step, counters) is replicated."""
    specs = nnx.get_partition_spec(abstract_state)
    return jax.tree.map(lambda s: NamedSharding(mesh, s if isinstance(s, P) else P()), specs,
                        is_leaf=lambda x: isinstance(x, P) or x is None)


def _split_model(cfg: Config, stages: int, virtual: int):
    """(graphdef, params, lora, fp8) of a freshly initialised model, the stacked leaves in
    storage order. Split by type: the weights (nnx.Param), LoRA adapters (LoRA: empty unless
    lora.rank > 0) and fp8_delayed's amax histories (Fp8Meta); exhaustive, so any other state
    would be an error here."""
    model = model_spec(cfg.model).build(cfg.model, cfg.execution,
                                        rngs=nnx.Rngs(params=cfg.train.seed), lora=cfg.lora)
    graphdef, params, lora, fp8 = nnx.split(model, nnx.Param, LoRA, Fp8Meta)
    # The same logical weights whatever the layout; only their order in the stack differs.
    params["layers"] = to_storage_order(params["layers"], stages, virtual)
    for extra in (lora, fp8):  # stacked like the layers they belong to
        if jax.tree.leaves(extra):
            extra["layers"] = to_storage_order(extra["layers"], stages, virtual)
    return graphdef, params, lora, fp8


def _make_init(cfg: Config, tx: optax.GradientTransformation, mesh):
    box = {}
    stages, virtual = mesh.shape["pipeline"], cfg.pipeline.resolved_virtual_stages

    def init():
        graphdef, params, lora, fp8 = _split_model(cfg, stages, virtual)
        box["graphdef"] = graphdef
        state = {"step": jnp.zeros((), jnp.int32), "params": params}
        if cfg.lora.enabled:
            # LoRA: params is the frozen base; the optimizer sees the adapters alone.
            state["lora"] = lora
            state["opt_state"] = tx.init(lora)
        else:
            state["opt_state"] = tx.init(params)
        if jax.tree.leaves(fp8):  # fp8_delayed only
            state["fp8"] = fp8
        return state

    return init, box


def abstract_train_state(cfg: Config, mesh, tx):
    """(graphdef, abstract state with shardings, shardings) without allocating anything.
    Checks the model and batch against the mesh first (ConfigError naming the fix). The
    leaves that train.offload_* put in host memory have memory_kind 'pinned_host' (so the
    state is created there, and checkpoints restore there)."""
    check_layout(cfg, mesh)
    init, box = _make_init(cfg, tx, mesh)
    with model_context(mesh):
        abstract = jax.eval_shape(init)
        shardings = _state_shardings(abstract, mesh)
    # (outside the mesh: optax runs tx.init eagerly to find the moments, on no device of it)
    shardings = offload.place_state(cfg, tx, shardings)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    return box["graphdef"], abstract, shardings


def create_train_state(cfg: Config, mesh, tx):
    """(graphdef, state, shardings) on device; state = {'step', 'params', 'opt_state'} and,
    under fp8_delayed, 'fp8': the amax histories (ops.Fp8Meta), outside params and so outside
    the optimizer (no moments, no weight decay, not in the gradient norm). With lora.rank > 0
    also 'lora', the adapters, which alone the optimizer (opt_state) trains."""
    graphdef, _, shardings = abstract_train_state(cfg, mesh, tx)
    init, _ = _make_init(cfg, tx, mesh)
    with model_context(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state, shardings


def with_fresh_adapters(cfg: Config, mesh, tx, state, shardings) -> dict:
    """state (restored from a checkpoint saved without LoRA: 'step', 'params'[, 'fp8']) with
    new adapters (B = 0: the model computes what the base does) and a fresh optimizer state
    for them: how a LoRA run starts from an imported model. Jitted with only those as
    outputs, so the model's fresh base weights are never materialised (dead code)."""
    init, _ = _make_init(cfg, tx, mesh)
    fresh = {k: shardings[k] for k in ("lora", "opt_state")}
    with model_context(mesh):
        new = jax.jit(lambda: {k: v for k, v in init().items() if k in fresh},
                      out_shardings=fresh)()
    return {**state, **new}


def jit_train_step(cfg: Config, mesh, graphdef, shardings, tx, schedule):
    """The train step jitted as the loop runs it: state and batch sharded, state donated."""
    from titanax.train.step import make_train_step

    batch_sharding = NamedSharding(mesh, batch_input_spec())
    return jax.jit(make_train_step(cfg, graphdef, tx, schedule),
                   in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None),
                   donate_argnums=(0,))


def jit_eval_step(cfg: Config, mesh, graphdef, shardings):
    """eval_fn(state, batch) -> (summed NLL, token count): the eval step jitted as the loop
    runs it, on the train state's params and, under fp8_delayed, its amax histories (the
    forward pass scales its FP8 casts by them). Nothing is donated."""
    from titanax.train.step import make_eval_step

    batch_sharding = NamedSharding(mesh, batch_input_spec())
    fn = jax.jit(make_eval_step(cfg, graphdef),
                 in_shardings=(shardings["params"], batch_sharding, shardings.get("fp8"),
                               shardings.get("lora")))
    # LoRA: the base and the adapters together (the model computes x W + scale (x A) B)
    return lambda state, batch: fn(state["params"], batch, state.get("fp8"), state.get("lora"))

def fresh_fp8_state(abstract_state) -> dict:
    """{'fp8': the amax histories at zero, as a new run starts them} under fp8_delayed, else
    {}: for code that builds a train state around other parameters (HF import)."""
    if "fp8" not in abstract_state:
        return {}
    return {"fp8": jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding),
                                abstract_state["fp8"])}
