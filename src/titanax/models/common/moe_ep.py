"""Expert parallelism (mesh.expert > 1): the experts are split over the `expert` mesh axis
(E / ep per device) and each (token, expert) pair travels to the device holding its expert and
back with two all-to-alls, inside a jax.shard_map manual over `expert` only (the other mesh
axes stay automatic: FSDP gathers, tensor-parallel expert widths, data and context split the
rest as before). parallel/rules.py puts `expert` into the batch's split too, so outside the
experts an expert rank is one more data-parallel rank, as TorchTitan and MaxText use it.

On each expert rank, for its T local tokens (T x K pairs):

    pairs sorted by expert (so by destination rank), each given its slot in a [ep, C, D] send
    buffer (C rows per destination) -> all_to_all -> the received [ep x C] rows sorted by local
    expert -> grouped GEMMs (ragged_dot; empty slots fall past the group sizes and compute
    nothing) -> back to received order -> all_to_all -> each pair's row read from its slot,
    weighted by its gate and summed per token.

C, the rows a rank may send to one destination: T x K (every pair to one rank: nothing is ever
dropped) unless execution.expert_capacity_factor is set, then ceil(factor x T x K / ep) as
Switch/GShard's capacity; pairs past it are dropped (they add nothing to their token's output,
the residual carries the token on) and counted in the step log (`aux/dropped_fraction`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from titanax.models.common.moe import Routing, grouped_mm, swiglu

AXIS = "expert"


def expert_parallelism() -> int:
    """The `expert` axis' size on the mesh in context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    return dict(mesh.shape).get(AXIS, 1)


def capacity(pairs: int, ep: int, factor: float | None) -> int:
    """Rows one rank may send to each destination rank."""
    if factor is None:
        return pairs
    return max(1, min(pairs, math.ceil(factor * pairs / ep)))


def experts_ep(x_TD, r: Routing, w_gate_EDF, w_up_EDF, w_down_EFD, *, dtype, precision=None,
               capacity_factor: float | None = None):
    """experts_ragged over the `expert` axis: (y [T, D] in dtype, pairs dropped [] float32).
    x_TD and r's tokens are split over the mesh's batch axes (T whole here: the shard_map takes
    its `expert` share); the weights' expert axis is split over `expert`."""
    ep = expert_parallelism()
    fn = lambda x, e, g, wg, wu, wd: _local(  # noqa: E731
        x, e, g, wg, wu, wd, ep=ep, dtype=dtype, precision=precision,
        capacity_factor=capacity_factor)
    rows, experts = P(AXIS), P(AXIS)
    y_TD, dropped = jax.shard_map(
        fn, in_specs=(rows, rows, rows, experts, experts, experts), out_specs=(rows, P()),
        axis_names=frozenset({AXIS}), check_vma=False,
    )(x_TD, r.expert_TK, r.gate_TK, w_gate_EDF, w_up_EDF, w_down_EFD)
    return y_TD, dropped


def _local(x_TD, expert_TK, gate_TK, w_gate, w_up, w_down, *, ep, dtype, precision,
           capacity_factor):
    """One expert rank's share (inside the shard_map)."""
    T, K = expert_TK.shape
    E_l, D = w_gate.shape[0], x_TD.shape[-1]
    N = T * K
    C = capacity(N, ep, capacity_factor)
    flat = expert_TK.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs by expert, hence by destination rank
    dest = flat[order] // E_l
    per_dest = jnp.zeros(ep, jnp.int32).at[dest].add(1)
    slot = jnp.arange(N, dtype=jnp.int32) - (jnp.cumsum(per_dest) - per_dest)[dest]
    kept = slot < C
    slot = jnp.where(kept, slot, C)  # out of range: dropped by the scatters below
    send_x = jnp.zeros((ep, C, D), dtype).at[dest, slot].set(
        x_TD.astype(dtype)[order // K], mode="drop")
    send_e = jnp.full((ep, C), E_l, jnp.int32).at[dest, slot].set(flat[order] % E_l,
                                                                    mode="drop")
    a2a = lambda a: jax.lax.all_to_all(a, AXIS, 0, 0, tiled=True)  # noqa: E731
    recv_x, recv_e = a2a(send_x).reshape(ep * C, D), a2a(send_e).reshape(ep * C)
    # Local experts' rows in expert order; empty slots (E_l) sort last, past every group.
    by_expert = jnp.argsort(recv_e, stable=True)
    sizes = jnp.zeros(E_l + 1, jnp.int32).at[recv_e].add(1)[:E_l]
    mm = lambda a, w: grouped_mm(a, w, sizes, dtype=dtype, precision=precision)  # noqa: E731
    xs = recv_x[by_expert]
    h = swiglu(mm(xs, w_gate), mm(xs, w_up)).astype(dtype)
    ys = jnp.zeros((ep * C, D), dtype).at[by_expert].set(mm(h, w_down).astype(dtype))
    back = a2a(ys.reshape(ep, C, D))  # [ep, C, D]: our pairs' rows, by destination and slot
    y_sorted = jnp.where(kept[:, None], back.at[dest, slot].get(mode="fill", fill_value=0), 0)
    y_ND = jnp.zeros((N, D), dtype).at[order].set(y_sorted)
    y_TD = jnp.einsum("tkd,tk->td", y_ND.reshape(T, K, D).astype(jnp.float32), gate_TK)
    dropped = jax.lax.psum(jnp.sum(~kept).astype(jnp.float32), AXIS)
    return y_TD.astype(dtype), dropped
