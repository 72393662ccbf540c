"""Host offload of the train state: for when the state alone exceeds HBM (Llama-3-70B with
float32 master weights and Adam on one 8 x H100 node needs 106 GB per GPU before gradients).

Options (config/train.py, all off by default):
- train.offload_optimizer: Adam's moments (the opt_state leaves that mirror the parameters,
  mu and nu) live in pinned host memory between steps.
- train.offload_params: the float32 master weights of the stacked decoder layers
  (params['layers'], 97% of Llama-3-70B) live in pinned host memory too. The layer scan brings
  each layer's slice over when it needs it (models/llama.py `_to_device`, inside the layer's
  checkpoint, so the forward, the remat recompute and the backward each fetch it again and no
  device copy of the stack is kept); the gradients of host-resident weights come out of the
  backward scan in host memory too (the transpose of the host-to-device copy), so the
  gradient norm reads them a layer at a time (`global_norm`).
- execution.remat = "full_offload" (models/llama.py): full remat whose saved layer inputs go to
  host memory.

`place_state` gives the offloaded leaves memory kind 'pinned_host' in the train state's
shardings (train/state.py): the state is created there, jit keeps it there between steps, and
orbax restores each leaf as the abstract state's sharding says, memory kind included. The
opt_state pytree and dtypes are optax's own, so checkpoints move freely between offload on and
off.

The update (`streamed_update`) computes what `tx.update` + `optax.apply_updates` + the
non-finite guard compute:
1. the global gradient norm over all gradients first (train_step's grad_norm);
2. the parameters outside the layer stack (embedding, output layer, final norm) updated whole
   (their moments brought over from the host and sent back);
3. the stacked layers by a lax.scan over the layer axis, every stacked leaf of the params and
   moments in the carry: one layer's rows are read (and copied to the device when the leaf
   lives on the host), updated and written back in place with dynamic_update_index_in_dim
   (copied back to the host first), so XLA updates the donated buffers in place, on the host
   or the device, and at most one layer's moments and weights are on the device at once. Each
   iteration clips with the global norm (optim.clip_leaf), runs the update rule of
   optim.py's table (optim.elementwise_update: the step's own chain without the clip, on trees
   whose other leaves are empty: the math is elementwise, step count and learning rate are
   scalars) and applies the guard, all elementwise. (fp8_delayed's amax
   histories are not parameters: they are the train state's statistics, in device memory,
   and the train step writes them.)
Elementwise means the layer order is irrelevant (circular pipelines store the stack
stage-major). With mesh.pipeline > 1 the stack is sharded on 'pipeline' along the layer axis,
and the scans run inside a shard_map over 'pipeline', each stage over its own L/PP rows (a
scan over the sharded axis would gather the whole stack on every stage).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from titanax.config import Config
from titanax.models.spec import no_decay_norms
from titanax.train.optim import clip_leaf, elementwise_update

HOST = "pinned_host"  # memory kind of offloaded leaves between steps
_LAYERS = "layers"
_PIPELINE = "pipeline"
_OTHER, _MOMENT, _LAYER_MOMENT = 0, 1, 2  # kinds of opt_state leaves (see _moment_kinds)


def enabled(cfg: Config) -> bool:
    """Does the train step take the streamed update (some state leaf lives on the host)?"""
    return cfg.train.offload_optimizer or cfg.train.offload_params


def is_layer_path(path) -> bool:
    """A params leaf (or moment leaf) of the stacked decoder layers."""
    return any(getattr(k, "key", None) == _LAYERS for k in path)


def on_host(x) -> bool:
    """Is x (an array or a tracer) in host memory?"""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def _to_device(x):
    return jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x


def _to_host(x):
    return jax.device_put(x, jax.memory.Space.Host)


# --- where the state lives ------------------------------------------------------------------

def _host_sharding(s: NamedSharding) -> NamedSharding:
    """s in pinned host memory. Compile-only devices (deviceless GPU compiles, perf/aot.py)
    list no memories, so a sharding on their mesh drops any memory kind; one on the same
    mesh's AbstractMesh keeps it, and jit lowers it onto the mesh in context."""
    out = NamedSharding(s.mesh, s.spec, memory_kind=HOST)
    if out.memory_kind != HOST:
        out = NamedSharding(s.mesh.abstract_mesh, s.spec, memory_kind=HOST)
    return out


def place_state(cfg: Config, tx, shardings):
    """The train state's shardings (a train/state.py TrainState of NamedShardings) with the
    leaves the train.offload_* options move in pinned host memory: the weights' stacked
    layers, the optimizer state's moments (the statistics, fp8_delayed's small amax
    histories, stay in device memory)."""
    if not enabled(cfg):
        return shardings
    out = shardings
    if cfg.train.offload_params:
        out = out.with_group(out.weights_role, jax.tree_util.tree_map_with_path(
            lambda p, s: _host_sharding(s) if is_layer_path(p) else s, out.weights))
    if cfg.train.offload_optimizer:
        out = out.replace(opt_state=optax.tree_utils.tree_map_params(
            tx, _host_sharding, out.opt_state, is_leaf=lambda x: isinstance(x, NamedSharding)))
    return out


# --- the update ------------------------------------------------------------------------------

def _pipeline_stages() -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh is None or mesh.empty else dict(mesh.shape).get(_PIPELINE, 1)


def _per_stage(fn, stacked, replicated, *, reduce: bool = False):
    """fn(stacked, replicated); stacked: [layers, ...] leaves sharded on 'pipeline' along the
    layer axis. With pipeline stages each runs fn on its own rows (a shard_map manual over
    'pipeline' only) and fn's outputs are its rows again, or (reduce) scalars summed over
    the stages."""
    if _pipeline_stages() == 1:
        return fn(stacked, replicated)

    def local(stacked, replicated):
        out = fn(stacked, replicated)
        return jax.lax.psum(out, _PIPELINE) if reduce else out

    return jax.shard_map(local, in_specs=(P(_PIPELINE), P()),
                         out_specs=P() if reduce else P(_PIPELINE),
                         axis_names={_PIPELINE})(stacked, replicated)


def global_norm(tree):
    """optax.tree.norm(tree) where some leaves may be in host memory (the gradients of the
    offloaded layer weights): those, all stacked [layers, ...], are read a layer at a time."""
    leaves = jax.tree.leaves(tree)
    host = [x for x in leaves if on_host(x)]
    if not host:
        return optax.tree.norm(tree)
    sq = lambda x: jnp.sum(jnp.square(x))
    total = sum((sq(x) for x in leaves if not on_host(x)), jnp.zeros((), jnp.float32))

    def scan(rows, _):
        add = lambda acc, r: (acc + sum(sq(_to_device(x)) for x in r), None)
        return jax.lax.scan(add, jnp.zeros((), jnp.float32), rows)[0]

    return jnp.sqrt(total + _per_stage(scan, host, None, reduce=True))


def _clip_fn(clip_norm: float, grad_norm):
    """The clipping step of optim.make_optimizer's chain, per leaf, given the global norm."""
    if clip_norm <= 0:
        return lambda t: t
    return lambda t: clip_leaf(t, grad_norm, clip_norm)


def _empty(x):
    """Stands in for a leaf the other part of the update handles: no elements, no work."""
    return jnp.zeros((0,), x.dtype)


def _moment_kinds(tx, opt_state, params) -> list[int]:
    """Per leaf of opt_state: _LAYER_MOMENT if it mirrors a stacked layer parameter, _MOMENT
    if it mirrors another parameter, _OTHER (step counts) if neither. optax itself finds the
    parameter-shaped subtrees (tree_map_params)."""
    layer = jax.tree_util.tree_map_with_path(lambda p, _: is_layer_path(p), params)
    kinds = optax.tree_utils.tree_map_params(
        tx, lambda _, is_layer: _LAYER_MOMENT if is_layer else _MOMENT, opt_state, layer,
        transform_non_params=lambda _: _OTHER)
    return jax.tree.leaves(kinds)


def _inner_state(cfg: Config, inner, opt_state, params):
    """opt_state's (rule state,), checked to be what optim.make_optimizer builds."""
    inner_state = tuple(opt_state[-1:])
    if (len(opt_state) != (2 if cfg.optim.clip_norm > 0 else 1)
            or jax.tree.structure(inner.init(params)) != jax.tree.structure(inner_state)):
        raise ValueError("train/offload.py expects optim.make_optimizer's chain("
                         "[clip_by_global_norm,] rule); teach streamed_update the new one")
    return inner_state


def streamed_update(cfg: Config, tx, grads, opt_state, params, grad_norm, finite, *,
                    no_decay=no_decay_norms):
    """(new params, new opt_state), as train_step computes them without offload:
        updates, new_state = tx.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        both kept at their old values where not `finite`
    with the stacked layers' leaves streamed a layer at a time. grad_norm: the global norm of
    grads; finite: a scalar bool. (fp8_delayed's histories are not parameters: the train step
    writes them, train/step.py.) no_decay: the model spec's rule, as make_optimizer's."""
    inner = elementwise_update(cfg, no_decay)
    inner_state = _inner_state(cfg, inner, opt_state, params)
    clip = _clip_fn(cfg.optim.clip_norm, grad_norm)
    keep = lambda new, old: jnp.where(finite, new, old)

    p_flat, p_def = jax.tree_util.tree_flatten_with_path(params)
    p_leaves = [x for _, x in p_flat]
    p_layer = [is_layer_path(path) for path, _ in p_flat]
    g_leaves = p_def.flatten_up_to(grads)
    s_leaves, s_def = jax.tree.flatten(inner_state)
    s_kind = _moment_kinds(inner, inner_state, params)

    def update(p, g, s):
        """The update rule on flat leaf lists of the full trees (the part at hand real, the
        rest _empty): (new params leaves, new state leaves)."""
        p_tree = jax.tree.unflatten(p_def, p)
        updates, new_s = inner.update(jax.tree.unflatten(p_def, [clip(x) for x in g]),
                                      jax.tree.unflatten(s_def, s), p_tree)
        return p_def.flatten_up_to(optax.apply_updates(p_tree, updates)), jax.tree.leaves(new_s)

    # --- outside the layer stack: whole leaves ------------------------------------------------
    rest = lambda leaves: [_empty(x) if l else _to_device(x) for x, l in zip(leaves, p_layer)]
    s_rest = [_empty(x) if k == _LAYER_MOMENT else _to_device(x)
              for x, k in zip(s_leaves, s_kind)]
    new_p_rest, new_s_rest = update(rest(p_leaves), rest(g_leaves), s_rest)
    new_p = [x if l else keep(n, x) for x, n, l in zip(p_leaves, new_p_rest, p_layer)]
    new_s = [x if k == _LAYER_MOMENT else _like(keep(n, _to_device(x)), x)
             for x, n, k in zip(s_leaves, new_s_rest, s_kind)]

    # --- the layer stack: one layer at a time ---------------------------------------------
    lp = [i for i, l in enumerate(p_layer) if l]  # its leaves among params
    ls = [i for i, k in enumerate(s_kind) if k == _LAYER_MOMENT]  # ... among the moments
    if lp:
        counts = {k: x for k, (x, kind) in enumerate(zip(s_leaves, s_kind)) if kind == _OTHER}
        scan = _layer_scan(update, keep, lp, ls, p_leaves, s_leaves)
        new_lp, new_ls = _per_stage(
            scan, ([p_leaves[k] for k in lp], [s_leaves[k] for k in ls],
                   [g_leaves[k] for k in lp]), counts)
        for k, x in zip(lp, new_lp):
            new_p[k] = x
        for k, x in zip(ls, new_ls):
            new_s[k] = x
    return (jax.tree.unflatten(p_def, new_p),
            (*opt_state[:-1], *jax.tree.unflatten(s_def, new_s)))


def _layer_scan(update, keep, lp, ls, p_leaves, s_leaves):
    """layer_scan((params rows, moment rows, gradient rows), counts) for _per_stage: a
    lax.scan over the stacked layers, updating each layer's rows in place. lp / ls: indices of
    the stacked leaves among the params / state leaves; counts: {index: the _OTHER state
    leaves (step counts), which all layers share}."""
    def layer_scan(stacked, counts):
        ps, ss, gs = stacked

        def body(carry, xs):
            ps, ss = carry
            i, g = xs
            row = lambda x: _to_device(jax.lax.dynamic_index_in_dim(x, i, keepdims=False))
            p_i, s_i = [row(x) for x in ps], [row(x) for x in ss]
            p, gv = [_empty(x) for x in p_leaves], [_empty(x) for x in p_leaves]
            for j, k in enumerate(lp):
                p[k], gv[k] = p_i[j], _to_device(g[j])
            s = [_empty(x) for x in s_leaves]
            for k, c in counts.items():
                s[k] = c
            for j, k in enumerate(ls):
                s[k] = s_i[j]
            new_p_all, new_s_all = update(p, gv, s)
            write = lambda x, new, old: jax.lax.dynamic_update_index_in_dim(
                x, _like(keep(new, old), x), i, 0)
            ps = [write(x, new_p_all[k], p_i[j]) for j, (k, x) in enumerate(zip(lp, ps))]
            ss = [write(x, new_s_all[k], s_i[j]) for j, (k, x) in enumerate(zip(ls, ss))]
            return (ps, ss), None

        (ps, ss), _ = jax.lax.scan(body, (ps, ss), (jnp.arange(ps[0].shape[0]), gs))
        return ps, ss

    return layer_scan


def _like(value, where):
    """value (on the device) moved to the memory `where` lives in."""
    return _to_host(value) if on_host(where) else value
