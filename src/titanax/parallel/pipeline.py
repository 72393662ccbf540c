"""Pipeline parallelism over the 'pipeline' mesh axis: jax.shard_map (manual over 'pipeline'
only, so data/fsdp/tensor sharding keeps working by propagation inside) and ppermute.

The stacked layers [L, ...] are sharded on 'pipeline' (parallel/rules.py), so stage s holds L/PP
consecutive rows of the stack and no weight ever moves. Those rows are cut into V chunks
(virtual stages) of Lc = L/(PP*V) layers. gpipe is V = 1. The circular (interleaved) schedule
sends each microbatch round the ring of stages V times; for that, stage s's row chunk v must be
logical layer chunk v*PP + s, so circular runs store the stack in that stage-major order
(parallel/layer_order.py, the one module that knows it).

Schedule (docs/parallelism.md): a global batch is cut into M microbatches; work item i = v*M + m
is microbatch m on its v-th trip round the ring. At tick t stage s runs item t - s (idle when
that is outside [0, M*V)); its output goes to stage s+1 by ppermute, and the last stage's output
goes back to stage 0, which parks it until it starts the item's next trip M ticks after the
previous one (so circular needs M >= PP). T = M*V + PP - 1 ticks, each stage busy M*V of them:
idle fraction (PP-1) / (M*V + PP - 1), at 1/V of the work per tick.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from titanax.config import PipelineConfig

AXIS = "pipeline"
_LAYER_INPUT = "pipeline_layer_input"


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    microbatches: int = 1
    virtual_stages: int = 1  # layer chunks per stage: 1 is gpipe, more is circular
    # 'gpipe' / 'circular' run here (all forwards, then autodiff's backward); '1f1b'
    # interleaves forward and backward in one tick loop (parallel/pipeline_1f1b.py).
    schedule: str = "gpipe"

    @classmethod
    def from_config(cls, cfg: PipelineConfig) -> PipelineSchedule:
        return cls(cfg.microbatches, cfg.resolved_virtual_stages, cfg.schedule)


def pipeline_stages() -> int:
    """Size of the 'pipeline' axis of the mesh in context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or AXIS not in mesh.axis_names:
        return 1
    return mesh.shape[AXIS]


def schedule_table(stages: int, microbatches: int, virtual_stages: int = 1) -> np.ndarray:
    """[ticks, stages]: the work item (v*M + m) each stage runs at each tick, -1 when idle; the
    same arithmetic as the tick loop in `run_pipelined`."""
    ticks = microbatches * virtual_stages + stages - 1
    item = np.arange(ticks)[:, None] - np.arange(stages)[None, :]
    return np.where((item >= 0) & (item < microbatches * virtual_stages), item, -1)


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Analytic idle share of stage time: (PP-1) / (M*V + PP-1)."""
    return (stages - 1) / (microbatches * virtual_stages + stages - 1)


def _to_microbatches(a, M: int):
    """[B, ...] -> [M, B/M, ...] with microbatch m = rows i*M + m: each data shard keeps its own
    rows (a plain [M, B/M] split would move rows between data-parallel devices)."""
    return jnp.swapaxes(a.reshape(a.shape[0] // M, M, *a.shape[1:]), 0, 1)


def _from_microbatches(a_M):
    return jnp.swapaxes(a_M, 0, 1).reshape(-1, *a_M.shape[2:])


def _from_last_stage(out_MbSD, s, stages: int, per: int):
    """Stage j gets microbatches [j*per, (j+1)*per) of the last stage's outputs.
    Point-to-point sends, not psum_scatter: XLA gathers the operand of a collective over
    'pipeline' across the automatic axes (rows over fsdp, sequence over tensor) first, 17 GB
    per device for the 70B NeMo-like layout; a ppermute moves each device's shard."""
    last = stages - 1
    mine = out_MbSD[last * per:(last + 1) * per]
    for j in range(stages - 1):
        got = jax.lax.ppermute(out_MbSD[j * per:(j + 1) * per], AXIS, [(last, j)])
        mine = jnp.where(s == j, got, mine)
    return mine


@jax.custom_vjp
def _fork_histories(meta, busy):
    """(histories carried to the next tick, histories this tick's layers use): the identity.

    fp8_delayed's amax histories (the layer state's Variables that are not nnx.Param:
    ops.Fp8Meta) get their updated values as "gradients" (pallas_kernels/fp8/linear.py).
    Closed over by the tick loop, autodiff would sum them over its ticks, idle ones included:
    histories scaled by the tick count on every step, compounding. Threaded through the loop
    as a carry and forked here, the backward instead keeps the elementwise maximum over the
    busy ticks: the step's largest amax, as one unpipelined batch records it."""
    return meta, meta


def _fork_histories_fwd(meta, busy):
    return (meta, meta), busy


def _fork_histories_bwd(busy, cts):
    later, here = cts  # later ticks' maximum so far, this tick's new histories
    return jax.tree.map(lambda a, b: jnp.where(busy, jnp.maximum(a, b), a), later, here), None


_fork_histories.defvjp(_fork_histories_fwd, _fork_histories_bwd)


def _is_history(v) -> bool:
    """A layer-state Variable that is not a weight: fp8_delayed's amax histories (ops.Fp8Meta),
    the only such state a layer holds (train/state.py splits the model exhaustively into
    nnx.Param and Fp8Meta, and LoRA adapters), identified by type without importing
    titanax.ops. A Variable type marked `trained = True` (models/common/lora.py LoRA) has
    true gradients, summed over the ticks like a weight's."""
    return (isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param)
            and not getattr(type(v), "trained", False))


def _split_histories(tree):
    """(the fp8_delayed history leaves of tree, merge(histories) -> tree with them put back)."""
    leaves, treedef = jax.tree.flatten(tree)
    # One array leaf per Variable, in the same order: a mask by Variable type lines up.
    is_meta = jax.tree.leaves(jax.tree.map(_is_history, tree,
                                           is_leaf=lambda x: isinstance(x, nnx.Variable)))
    assert len(is_meta) == len(leaves), "a layer-state Variable with more than one array"

    def merge(histories):
        it = iter(histories)
        return treedef.unflatten([next(it) if m else leaf for m, leaf in zip(is_meta, leaves)])

    return [leaf for m, leaf in zip(is_meta, leaves) if m], merge


def run_pipelined(layer_fn, layer_state, x_BSD, extras, schedule: PipelineSchedule,
                  *, with_busy: bool = False, aux_zeros=None):
    """layer_fn(x_bSD, one_layer_state, extras_b) -> x_bSD applied over all stacked layers, as
    jax.lax.scan would, but staged over the 'pipeline' axis. extras: a pytree of [B, ...] arrays
    split into microbatches with x (positions, segment ids). with_busy: also return how many
    ticks each stage did real work ([PP] int32), for bubble measurements. The output's rows
    are split over the stages too when M divides by them (rules.py 'loss_batch'), else
    replicated on every stage.

    aux_zeros: a pytree of sums the layers also return (an MoE layer's routing sums:
    layer_fn -> (x_bSD, aux)); their total over every layer and microbatch comes back as a
    second output (after the outputs, before busy), on every stage."""
    stages, V, M = pipeline_stages(), schedule.virtual_stages, schedule.microbatches
    if x_BSD.shape[0] % M:
        raise ValueError(f"batch of {x_BSD.shape[0]} does not split into {M} microbatches")
    if V > 1 and M < stages:
        raise ValueError(f"the circular schedule needs microbatches >= stages, got {M} < {stages}")
    x_MbSD = _to_microbatches(x_BSD, M)
    extras_M = jax.tree.map(lambda a: _to_microbatches(a, M), extras)
    scatter = M % stages == 0
    if aux_zeros is None:  # the stage program's aux sums are then empty
        plain = layer_fn
        layer_fn = lambda x, state, ex: (plain(x, state, ex), {})  # noqa: E731
    # An MoE layer's experts run in a shard_map of their own (models/common/moe_ep.py), which
    # jax 0.11.2 can only differentiate inside this one with varying-axis checks off in both:
    # with them on, the nested one's residuals and transpose come out sharded over
    # 'pipeline', which Shardy refuses ("operates on axis 'pipeline' which is already bound
    # by a parent sdy.manual_computation op"). Unchecked, shard_map's transpose divides the
    # replicated outputs' cotangents by the axis size and sums the replicated inputs' ones:
    # the same gradients (tests/test_moe_model.py).
    check = aux_zeros is None
    out_MbSD, aux, busy_P = jax.shard_map(
        _stage_fn(layer_fn, stages, V, M, scatter, aux_zeros or {}, check),
        in_specs=(P(AXIS), P(), P()), out_specs=(P(AXIS) if scatter else P(), P(), P(AXIS)),
        axis_names={AXIS}, check_vma=check)(layer_state, x_MbSD, extras_M)
    out = (_from_microbatches(out_MbSD),) + ((aux,) if aux_zeros is not None else ())
    out += (busy_P,) if with_busy else ()
    return out if len(out) > 1 else out[0]


def _chunk_runner(layer_fn, with_histories):
    """run_chunk(v, x_bSD, extras_b, histories, aux_zeros) -> (x_bSD, the chunk's aux sums):
    this stage's layer chunk v. with_histories: _split_histories' merge, giving the stage's
    rows as [V, Lc, ...] with `histories` in."""
    def chunk_forward(v, x_bSD, extras_b, histories, aux_zeros):
        chunk = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, keepdims=False),
                             with_histories(histories))

        def one(carry, layer):
            x, total = carry
            x, aux = layer_fn(checkpoint_name(x, _LAYER_INPUT), layer, extras_b)
            return (x, jax.tree.map(jnp.add, total, aux)), None

        return jax.lax.scan(one, (x_bSD, aux_zeros), chunk)[0]

    # The backward keeps each layer's input and nothing else per tick: without this the
    # chunk of weights picked by the (traced) v would be saved on every tick, a copy of the
    # stage's weights per tick; they are re-indexed instead (no FLOPs).
    return jax.checkpoint(chunk_forward,
                          policy=jax.checkpoint_policies.save_only_these_names(_LAYER_INPUT))


def _stage_fn(layer_fn, stages: int, V: int, M: int, scatter: bool, aux_zeros, check: bool):
    """One stage's program under shard_map: the tick loop (module docstring) over its layer
    rows; returns (its outputs, the layers' aux sums over all stages and busy ticks, how many
    ticks it was busy [1]). check: the shard_map checks varying axes (run_pipelined)."""
    ticks = M * V + stages - 1
    ring = [(k, (k + 1) % stages) for k in range(stages)]

    def stage_fn(local_state, x_MbSD, extras_M):
        s = jax.lax.axis_index(AXIS)
        # This stage's rows [L/PP, ...] as [V, Lc, ...]: chunk v is its v-th trip's layers.
        chunks = jax.tree.map(lambda a: a.reshape(V, a.shape[0] // V, *a.shape[1:]), local_state)
        # fp8_delayed amax histories travel through the tick loop (_fork_histories).
        histories, with_histories = _split_histories(chunks)
        run_chunk = _chunk_runner(layer_fn, with_histories)
        vary = (lambda a: jax.lax.pcast(a, AXIS, to="varying")) if check else (lambda a: a)
        # Stage 0's inputs: the fresh microbatches, overwritten by items coming back round.
        parked_MbSD = vary(x_MbSD)
        out_MbSD = vary(jnp.zeros_like(x_MbSD))
        recv_bSD = vary(jnp.zeros_like(x_MbSD[0]))
        zeros = jax.tree.map(vary, aux_zeros)

        def tick(carry, t):
            parked_MbSD, out_MbSD, recv_bSD, histories, aux_total = carry
            back = t - stages  # the item the last stage finished at tick t-1, now at stage 0
            slot = jnp.remainder(back, M)
            park = (s == 0) & (back >= 0) & (back < M * (V - 1))  # it has trips left
            parked_MbSD = jax.lax.dynamic_update_index_in_dim(
                parked_MbSD, jnp.where(park, recv_bSD, parked_MbSD[slot]), slot, 0)
            item = t - s
            busy = (item >= 0) & (item < M * V)
            item = jnp.clip(item, 0, M * V - 1)
            v, m = item // M, item % M
            x_bSD = jnp.where(s == 0, parked_MbSD[m], recv_bSD)
            extras_b = jax.tree.map(lambda a: a[m], extras_M)
            used = histories
            if histories:
                histories, used = _fork_histories(histories, busy)
            y_bSD, aux = run_chunk(v, x_bSD, extras_b, used, zeros)
            # An idle tick ran a clipped item's layers: its sums count for nothing.
            aux_total = jax.tree.map(lambda a, b: a + jnp.where(busy, b, 0), aux_total, aux)
            done = busy & (s == stages - 1) & (v == V - 1)
            out_MbSD = jax.lax.dynamic_update_index_in_dim(
                out_MbSD, jnp.where(done, y_bSD, out_MbSD[m]), m, 0)
            recv_bSD = jax.lax.ppermute(y_bSD, AXIS, ring)
            return (parked_MbSD, out_MbSD, recv_bSD, histories, aux_total), busy

        (_, out_MbSD, _, _, aux_total), busy_per_tick = jax.lax.scan(
            tick, (parked_MbSD, out_MbSD, recv_bSD, histories, zeros), jnp.arange(ticks))
        # Only the last stage holds the outputs. Scattered, each stage gets M/PP of the
        # microbatches, so what follows (the output layer and the loss) runs once per
        # microbatch, spread over the stages, not on every stage for all of them.
        if scatter:
            out_MbSD = _from_last_stage(out_MbSD, s, stages, M // stages)
        else:  # every stage gets all of them (out_specs P() needs a psum's invariant type)
            out_MbSD = jax.lax.psum(jnp.where(s == stages - 1, out_MbSD, 0), AXIS)
        aux_total = jax.tree.map(lambda a: jax.lax.psum(a, AXIS), aux_total)
        return out_MbSD, aux_total, busy_per_tick.sum(dtype=jnp.int32)[None]

    return stage_fn
