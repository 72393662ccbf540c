"""The experts on a mesh: each device dispatches only its own tokens. A jax.shard_map manual
over the token axes (the rows' 'batch' and the sequence's 'seq' axes: data, fsdp, expert,
context) and the experts' axes ('expert', and 'mlp' = tensor for their width) runs the
routing's sort and gather per device; without it XLA's partitioner would see one global sort
of every (token, expert) pair of the step and replicate it (656 GB of temporaries for
Qwen3-30B-A3B on 8 H100s, docs/moe.md). parallel/rules.expert_specs says how each operand
splits; FSDP gathers the experts' weights at the shard_map's edge as it gathers any weight.

mesh.tensor > 1: each tensor rank runs its slice of every expert's width F (Megatron's expert
tensor parallelism: up projections column-split, the down projection row-split) on the same
tokens, and the outputs are summed over 'tensor'.

mesh.expert = ep > 1: the experts are split over the `expert` axis (E / ep per device) and each
(token, expert) pair travels to the device holding its expert and back with two all-to-alls.
parallel/rules.py puts `expert` into the batch's split too, so outside the experts an expert
rank is one more data-parallel rank, as TorchTitan and MaxText use it. On each device, for its
R tokens (R x A pairs):

    pairs sorted by expert (so by destination rank), each given its slot in a [ep, cap, D]
    send buffer (cap rows per destination) -> all_to_all -> the received [ep x cap] rows sorted
    by local expert -> grouped GEMMs (ragged_dot; empty slots fall past the group sizes and compute
    nothing) -> back to received order -> all_to_all -> each pair's row read from its slot,
    weighted by its gate and summed per token.

cap (capacity), the rows a rank may send to one destination: R x A (every pair to one rank:
nothing is ever dropped) unless execution.expert_capacity_factor is set, then
ceil(factor x R x A / ep) as Switch/GShard's capacity; pairs past it are dropped (they add nothing to their token's output,
the residual carries the token on) and counted in the step log (`aux/dropped_fraction`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from titanax.models.common.moe import (
    Routing,
    combine_pairs,
    experts_of_pairs,
    gather_pairs,
    grouped_mm,
    sort_pairs,
    swiglu,
)
from titanax.parallel.rules import expert_specs, spec_axes

AXIS = "expert"


def expert_parallelism() -> int:
    """The `expert` axis' size on the mesh in context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    return dict(mesh.shape).get(AXIS, 1)


def on_mesh() -> bool:
    """Whether a mesh of more than one device is in context (the experts then run sharded)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh is not None and not mesh.empty and mesh.size > 1


def in_shard_map() -> bool:
    """Whether some mesh axes are already manual (a pipeline stage of an MoE model,
    parallel/pipeline.py, which runs it with varying-axis checks off: jax 0.11.2 can only
    differentiate the experts' shard_map nested in the stage's with both unchecked)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh is not None and not mesh.empty and bool(mesh.manual_axes)


def capacity(pairs: int, ep: int, factor: float | None) -> int:
    """Rows one rank may send to each destination rank."""
    if factor is None:
        return pairs
    return max(1, min(pairs, math.ceil(factor * pairs / ep)))


def experts_sharded(x_BSD, r: Routing, w_gate_EDF, w_up_EDF, w_down_EFD, *, dtype,
                    precision=None, capacity_factor: float | None = None):
    """experts_ragged per device on a mesh: (y [B, S, D] in dtype, pairs dropped [] float32,
    summed over the step's devices). r's [R, A] arrays are over R = B x S tokens; the weights
    arrive as the parameters are sharded (the shard_map takes its share)."""
    B, S, D = x_BSD.shape
    A = r.expert_RA.shape[-1]
    tokens, up, down = expert_specs(x_BSD.shape)
    token_axes = spec_axes(tokens)
    width_axes = tuple(a for a in spec_axes(up) if a != AXIS)
    ep = expert_parallelism()
    if ep > 1 and AXIS not in token_axes:
        raise ValueError(f"{B} rows do not split over the {ep} expert ranks: expert "
                         "parallelism needs every expert rank to hold its own tokens")
    cap = capacity(B * S * A // _size(token_axes), ep, capacity_factor)

    def local(x_BSD, expert_BSA, gate_BSA, wg, wu, wd):
        b, s = x_BSD.shape[:2]
        x_RD = x_BSD.reshape(b * s, D)
        e_RA, g_RA = expert_BSA.reshape(b * s, A), gate_BSA.reshape(b * s, A)
        if ep > 1:
            y_RD, dropped = _exchange(x_RD, e_RA, g_RA, wg, wu, wd, ep=ep, cap=cap, dtype=dtype,
                                      precision=precision)
        else:
            y_RD = experts_of_pairs(x_RD, e_RA, g_RA, wg, wu, wd, dtype=dtype,
                                    precision=precision)
            dropped = jnp.zeros((), jnp.float32)
        if width_axes:  # each tensor rank computed its slice of the experts' width
            y_RD = jax.lax.psum(y_RD, width_axes)
        return y_RD.reshape(b, s, D), jax.lax.psum(dropped, token_axes)

    return jax.shard_map(
        local, in_specs=(tokens, tokens, tokens, up, up, down), out_specs=(tokens, P()),
        axis_names=frozenset(token_axes + width_axes), check_vma=not in_shard_map(),
    )(x_BSD.astype(dtype), r.expert_RA.reshape(B, S, A), r.gate_RA.reshape(B, S, A),
      w_gate_EDF.astype(dtype), w_up_EDF.astype(dtype), w_down_EFD.astype(dtype))


def _size(axes) -> int:
    shape = dict(jax.sharding.get_abstract_mesh().shape)
    return math.prod(shape[a] for a in axes)


def _exchange(x_RD, expert_RA, gate_RA, w_gate, w_up, w_down, *, ep, cap, dtype, precision):
    """One expert rank's experts over its tokens' pairs, via two all-to-alls (module
    docstring): (y [R, D] in dtype, pairs dropped [] float32). Every row moves by a gather or
    scatter whose indices are distinct (moe.py: their gradients are gathers and scatters of
    the same kind)."""
    _, A = expert_RA.shape
    E_l, D = w_gate.shape[0], x_RD.shape[-1]
    flat = expert_RA.reshape(-1)
    order, inverse = sort_pairs(flat)  # by expert, hence by destination rank
    dest = flat[order] // E_l
    per_dest = jnp.zeros(ep, jnp.int32).at[dest].add(1)
    slot = jnp.arange(flat.shape[0], dtype=jnp.int32) - (jnp.cumsum(per_dest) - per_dest)[dest]
    kept = slot < cap
    # Dropped pairs: each its own slot past the buffer, so the indices stay distinct and the
    # scatter and gather below skip them.
    slot = jnp.where(kept, slot, cap + jnp.arange(flat.shape[0], dtype=jnp.int32))
    rows = gather_pairs(x_RD.astype(dtype), order, inverse, A)
    send_x = jnp.zeros((ep, cap, D), dtype).at[dest, slot].set(rows, mode="drop",
                                                             unique_indices=True)
    send_e = jnp.full((ep, cap), E_l, jnp.int32).at[dest, slot].set(flat[order] % E_l,
                                                                    mode="drop")
    a2a = lambda a: jax.lax.all_to_all(a, AXIS, 0, 0, tiled=True)  # noqa: E731
    recv_x, recv_e = a2a(send_x).reshape(ep * cap, D), a2a(send_e).reshape(ep * cap)
    # Local experts' rows in expert order; empty slots (E_l) sort last, past every group.
    by_expert, back_order = sort_pairs(recv_e)
    sizes = jnp.zeros(E_l + 1, jnp.int32).at[recv_e].add(1)[:E_l]
    mm = lambda a, w: grouped_mm(a, w, sizes, dtype=dtype, precision=precision)  # noqa: E731
    xs = recv_x.at[by_expert].get(unique_indices=True)
    h = swiglu(mm(xs, w_gate).astype(jnp.float32), mm(xs, w_up).astype(jnp.float32))
    ys = mm(h.astype(dtype), w_down).astype(dtype).at[back_order].get(unique_indices=True)
    back = a2a(ys.reshape(ep, cap, D))  # [ep, cap, D]: our pairs' rows, by destination and slot
    y_sorted = back.at[dest, slot].get(mode="fill", fill_value=0, unique_indices=True)
    return (combine_pairs(y_sorted, inverse, gate_RA).astype(dtype),
            jnp.sum(~kept).astype(jnp.float32))
