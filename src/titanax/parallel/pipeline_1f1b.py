"""Fused 1F1B pipeline schedule (V = 1, gpipe layer order): forward and backward of different
microbatches interleave in one tick scan, so a stage keeps only the microbatches in flight.

`run_pipelined` differentiates a forward tick scan, so its backward keeps every layer's input for
every tick: activation memory grows with the microbatches M. Here the loss and all gradients come
out of one forward program (jax.custom_vjp: the gradients are the residuals, the backward rule
only scales them), and each tick runs one forward slot and one backward slot per stage:

- stage s runs the forward of microbatch m at tick m + s and writes the input of each of its
  L/PP layers, in place, into a ring buffer [K, L/PP, b, S, D] of K = min(M, 2PP - 1) slots
  (slot m % K);
- the last stage runs head_fn's value_and_grad on its output in the same tick, then that
  microbatch's backward; stage s runs the backward of m at tick m + 2(PP - 1) - s, walking its
  layers in reverse with jax.vjp of layer_fn on the stored input (recompute, as full remat)
  and accumulating the layer-parameter gradients in a float32 carry;
- activations go s -> s+1 and gradients s -> s-1 by ppermute at the end of each tick.

T = M + 2(PP - 1) ticks, but idle slots are skipped by lax.cond, so the step takes about
(M + PP - 1)(F + B), B counting the recomputed forward: the gpipe bubble. The ppermutes sit
outside every cond (each stage must reach them every tick); collectives that the automatic axes
(data/fsdp/tensor) need inside layer_fn or head_fn do run inside the conds, which is sound as
every device of such a group is on the same stage and takes the same branch. Microbatch m is in flight at stage s from tick m + s to
m + 2(PP - 1) - s, at most 2(PP - 1 - s) + 1 microbatches at once: K at stage 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from titanax.parallel.pipeline import AXIS, _from_microbatches, _to_microbatches, pipeline_stages


def in_flight(stages: int, microbatches: int) -> int:
    """K: microbatches whose layer inputs a stage holds at once (stage 0 holds the most)."""
    return min(microbatches, 2 * stages - 1)


def ticks_1f1b(stages: int, microbatches: int) -> int:
    """Ticks of the scan; the last (PP - 1) of the warm-up and cool-down run one slot only."""
    return microbatches + 2 * (stages - 1)


def _tick_items(t, s, stages: int, microbatches: int):
    """(forward microbatch, busy, backward microbatch, busy) of stage s at tick t; numpy or jnp
    arithmetic, so `schedule_table_1f1b` and the compiled tick loop are the same formula."""
    m_fwd, m_bwd = t - s, t - 2 * (stages - 1) + s
    return (m_fwd, (m_fwd >= 0) & (m_fwd < microbatches),
            m_bwd, (m_bwd >= 0) & (m_bwd < microbatches))


def schedule_table_1f1b(stages: int, microbatches: int) -> np.ndarray:
    """[ticks, stages, 2]: the microbatch each stage runs forward ([..., 0]) and backward
    ([..., 1]) at each tick, -1 when that slot is idle."""
    t = np.arange(ticks_1f1b(stages, microbatches))[:, None]
    m_f, busy_f, m_b, busy_b = _tick_items(t, np.arange(stages)[None, :], stages, microbatches)
    return np.stack([np.where(busy_f, m_f, -1), np.where(busy_b, m_b, -1)], axis=-1)


def _vary(a):
    """Type an invariant value as differing per stage (shard_map's varying-axes check): values
    born on every stage alike (zeros, P() inputs) must be cast before they meet per-stage ones.
    Casting head_params also keeps head_fn's gradient per stage: the gradient of an invariant
    value used by varying ones would carry a psum, a collective inside lax.cond."""
    return jax.lax.pcast(a, AXIS, to="varying")


def _pick(tree, m):
    return jax.tree.map(lambda a: a[m], tree)


class _Stage:
    """One stage's view inside shard_map: its layers, the microbatches, and what a tick runs.
    Each slot (forward, head, backward) runs under lax.cond, so an idle one costs nothing."""

    def __init__(self, layer_fn, head_fn, local_state, head_params, x_MbSD, extras_M,
                 head_extras_M, stages: int):
        self.layer_fn, self.head_fn, self.stages = layer_fn, head_fn, stages
        self.s = jax.lax.axis_index(AXIS)
        self.last = self.s == stages - 1
        self.head_params, self.x_MbSD, self.extras_M, self.head_extras_M = jax.tree.map(
            _vary, (head_params, x_MbSD, extras_M, head_extras_M))
        self.local_state = local_state  # on P(AXIS): varies per stage already
        self.M = x_MbSD.shape[0]
        self.K = in_flight(stages, self.M)
        self.n_local = jax.tree.leaves(local_state)[0].shape[0]
        self.zero_bSD = _vary(jnp.zeros(x_MbSD.shape[1:], x_MbSD.dtype))

    def forward(self, x_bSD, m, ins):
        # Writes each layer's input into the ring slot m % K (what the backward recomputes
        # from), in place: no [L/PP, b, S, D] staging copy.
        ex = _pick(self.extras_M, m)

        def one(carry, l):
            x_bSD, ins = carry
            ins = ins.at[m % self.K, l].set(x_bSD)
            return (self.layer_fn(x_bSD, _pick(self.local_state, l), ex), ins), None

        return jax.lax.scan(one, (x_bSD, ins), jnp.arange(self.n_local))[0]

    def forward_only(self, x_bSD, m):
        ex = _pick(self.extras_M, m)
        return jax.lax.scan(lambda x, w: (self.layer_fn(x, w, ex), None), x_bSD,
                            self.local_state)[0]

    def head(self, y_bSD, m, loss, dhead):
        loss_b, (dh, dy_bSD) = jax.value_and_grad(self.head_fn, argnums=(0, 1))(
            self.head_params, y_bSD, _pick(self.head_extras_M, m))
        dhead = jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), dhead, dh)
        return loss + loss_b.astype(jnp.float32), dhead, dy_bSD.astype(y_bSD.dtype)

    def head_value(self, y_bSD, m, loss):
        return loss + self.head_fn(self.head_params, y_bSD,
                                   _pick(self.head_extras_M, m)).astype(jnp.float32)

    def backward(self, g_bSD, ins, m, dlayers):
        ex = _pick(self.extras_M, m)

        def one(carry, l):  # layer l of this stage, last to first
            g_bSD, dlayers = carry
            w = _pick(self.local_state, l)
            _, vjp = jax.vjp(lambda x, w: self.layer_fn(x, w, ex), ins[m % self.K, l], w)
            dx_bSD, dw = vjp(g_bSD)
            dlayers = jax.tree.map(lambda acc, d: acc.at[l].add(d.astype(acc.dtype)),
                                   dlayers, dw)
            return (dx_bSD, dlayers), None

        return jax.lax.scan(one, (g_bSD, dlayers), jnp.arange(self.n_local - 1, -1, -1))[0]

    def _forward_input(self, c, t):
        """(tick's items, forward input): stage 0 reads its microbatch, the others what s-1
        sent last tick."""
        m_f, busy_f, m_b, busy_b = _tick_items(t, self.s, self.stages, self.M)
        m_f, m_b = jnp.clip(m_f, 0, self.M - 1), jnp.clip(m_b, 0, self.M - 1)
        x_bSD = jnp.where(self.s == 0, self.x_MbSD[m_f], c["recv_f"])
        return (m_f, busy_f, m_b, busy_b), x_bSD

    def eval_tick(self, carry, t):
        """Forward slots only (gpipe order): the loss without gradients."""
        c = dict(carry)
        (m_f, busy_f, _, _), x_bSD = self._forward_input(c, t)
        y_bSD = jax.lax.cond(busy_f, self.forward_only, lambda x, m: x, x_bSD, m_f)
        c["loss"] = jax.lax.cond(busy_f & self.last, self.head_value, lambda y, m, l: l,
                                 y_bSD, m_f, c["loss"])
        c["recv_f"] = jax.lax.ppermute(y_bSD, AXIS, _to_next(self.stages))
        return c, None

    def train_tick(self, carry, t):
        """One forward slot, the head where the last stage's forward ended, one backward
        slot, then the sends both ways."""
        c = dict(carry)
        (m_f, busy_f, m_b, busy_b), x_bSD = self._forward_input(c, t)
        # Slot m_f % K is free: its previous microbatch finished its backward here.
        y_bSD, c["ins"] = jax.lax.cond(busy_f, self.forward, lambda x, m, ins: (x, ins),
                                       x_bSD, m_f, c["ins"])
        c["loss"], c["dhead"], dy_bSD = jax.lax.cond(
            busy_f & self.last, self.head, lambda y, m, l, d: (l, d, self.zero_bSD),
            y_bSD, m_f, c["loss"], c["dhead"])
        # Backward slot (after the forward: on the last stage it is the same microbatch).
        g_bSD = jnp.where(self.last, dy_bSD, c["recv_b"])
        g_bSD, c["dlayers"] = jax.lax.cond(
            busy_b, self.backward, lambda g, ins, m, d: (self.zero_bSD, d),
            g_bSD, c["ins"], m_b, c["dlayers"])
        c["dx"] = jax.lax.dynamic_update_index_in_dim(
            c["dx"], jnp.where(busy_b & (self.s == 0), g_bSD, c["dx"][m_b]), m_b, 0)
        # Outside every cond: all stages must reach the collectives each tick.
        c["recv_f"] = jax.lax.ppermute(y_bSD, AXIS, _to_next(self.stages))
        c["recv_b"] = jax.lax.ppermute(g_bSD, AXIS, _to_prev(self.stages))
        return c, None

    def initial_carry(self, train: bool) -> dict:
        carry = {"recv_f": self.zero_bSD, "loss": _vary(jnp.zeros((), jnp.float32))}
        if train:  # gradients accumulate in float32
            f32 = lambda a: _vary(jnp.zeros(a.shape, jnp.float32))
            carry.update(
                recv_b=self.zero_bSD,
                ins=_vary(jnp.zeros((self.K, self.n_local, *self.x_MbSD.shape[1:]),
                                    self.x_MbSD.dtype)),
                dhead=jax.tree.map(f32, self.head_params),
                dlayers=jax.tree.map(f32, self.local_state),
                dx=_vary(jnp.zeros(self.x_MbSD.shape, self.x_MbSD.dtype)))
        return carry

    def outputs(self, c: dict, train: bool):
        loss = jax.lax.psum(c["loss"], AXIS)  # only the last stage ran the head
        if not train:
            return loss
        cast = lambda acc, p: acc.astype(p.dtype)
        return (loss, jax.tree.map(cast, c["dlayers"], self.local_state),
                jax.tree.map(cast, jax.lax.psum(c["dhead"], AXIS), self.head_params),
                c["dx"][None])  # stage 0's is the one; see run_1f1b


def _to_next(stages: int):
    return [(k, k + 1) for k in range(stages - 1)]


def _to_prev(stages: int):
    return [(k + 1, k) for k in range(stages - 1)]


def _schedule(layer_fn, head_fn, layer_state, head_params, x_MbSD, extras_M, head_extras_M,
              train: bool):
    """The tick scan under shard_map. train: loss and (layer, head, x) gradients with the 1F1B
    ticks; otherwise the loss alone with forward ticks only (M + PP - 1, gpipe order)."""
    stages, M = pipeline_stages(), x_MbSD.shape[0]
    ticks = ticks_1f1b(stages, M) if train else M + stages - 1

    def stage_fn(local_state, head_params, x_MbSD, extras_M, head_extras_M):
        stage = _Stage(layer_fn, head_fn, local_state, head_params, x_MbSD, extras_M,
                       head_extras_M, stages)
        tick = stage.train_tick if train else stage.eval_tick
        c = jax.lax.scan(tick, stage.initial_carry(train), jnp.arange(ticks))[0]
        return stage.outputs(c, train)

    out_specs = (P(), P(AXIS), P(), P(AXIS)) if train else P()
    return jax.shard_map(stage_fn, in_specs=(P(AXIS), P(), P(), P(), P()), out_specs=out_specs,
                         axis_names={AXIS})(layer_state, head_params, x_MbSD, extras_M,
                                            head_extras_M)


def run_1f1b(layer_fn, head_fn, layer_state, head_params, x_BSD, extras, head_extras,
             microbatches: int) -> jax.Array:
    """Scalar float32: sum over microbatches of head_fn(head_params, y_bSD, head_extras_b), y the
    output of all stacked layers applied to microbatch b of x. Differentiable (jax.grad /
    value_and_grad) w.r.t. layer_state, head_params and x_BSD.

    layer_fn(x_bSD, one_layer_state, extras_b) -> x_bSD; layer_state: [L, ...] leaves sharded on
    'pipeline'; extras / head_extras: pytrees of [B, ...] arrays without gradient (integers);
    head_fn(head_params, y_bSD, head_extras_b) -> scalar; head_params replicated on 'pipeline'.
    Microbatch m is rows m, m + M, ... of the batch (data sharding stays on rows)."""
    M = microbatches
    if x_BSD.shape[0] % M:
        raise ValueError(f"batch of {x_BSD.shape[0]} does not split into {M} microbatches")
    n_layers = jax.tree.leaves(layer_state)[0].shape[0]
    if n_layers % pipeline_stages():
        raise ValueError(f"{n_layers} layers do not split over {pipeline_stages()} stages")
    split = lambda tree: jax.tree.map(lambda a: _to_microbatches(a, M), tree)

    def run(train, layer_state, head_params, x_BSD, extras, head_extras):
        return _schedule(layer_fn, head_fn, layer_state, head_params, _to_microbatches(x_BSD, M),
                         split(extras), split(head_extras), train)

    @jax.custom_vjp
    def loss_fn(*args):  # not differentiated (evaluation): forward ticks only
        return run(False, *args)

    def loss_fwd(*args):  # differentiated: the whole 1F1B schedule, gradients as residuals
        loss, dlayers, dhead, dx_PMbSD = run(True, *args)
        # dx leaves per stage and stage 0's is taken out here, not psum'd inside: a bfloat16
        # psum inside a partly manual shard_map aborts XLA:CPU (AllReducePromotion finds a
        # copy, the sharding constraint, in the reducer; jax 0.11.2).
        return loss, (dlayers, dhead, _from_microbatches(dx_PMbSD[0]))

    def loss_bwd(grads, g):
        scale = lambda a: (a * g).astype(a.dtype)
        return (*jax.tree.map(scale, grads), None, None)  # no cotangent for the integer extras

    loss_fn.defvjp(loss_fwd, loss_bwd)
    return loss_fn(layer_state, head_params, x_BSD, extras, head_extras)
