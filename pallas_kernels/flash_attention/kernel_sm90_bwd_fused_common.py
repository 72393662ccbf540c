"""What the two forms of the fused sm90 backward share: kernel_sm90_bwd_fused.py (FA3's
asynchronous form, head_dim <= its ASYNC_MAX_HEAD_DIM) and kernel_sm90_bwd_fused_sync.py (the
synchronous form it runs above that). Both run one CTA per (2 x block_kv_bwd keys, kv head,
batch) with two consumer warpgroups and a producer; they differ only in each consumer's step
(its waits and where dQ is reduced) and in the producer. Shared here, so the two stay one
kernel with two steps: the launch, the CTA's query range, a consumer's own tiles and mask
bounds, the loop over q heads, and the SMEM and barriers both declare.

The order of the operations each helper emits is the order the kernels emitted before they
shared it: the SASS tables of docs/attention.md (launch.ptxas_report --sass) are unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..target import out_struct
from .mosaic_common import (
    END,
    FIRST,
    FULL_HI,
    FULL_LO,
    cta_ranges,
    interpret_ctx,
    kv_major_bars,
    kv_major_smem,
    load_own_tiles,
    reduce_added_dq,
    softmax_delta,
)
from .tile_ranges import tile_ranges

WGS = 2  # consumer warpgroups: each owns block_kv_bwd keys
# setmaxnreg as kernel_sm90_bwd.py: 2 x 240 + 24 spends the 168 per thread the CTA starts with.
REGS_COMPUTE, REGS_PRODUCER = 240, 24
MAX_HEAD_DIM = 128  # above, dK and dV do not fit a warpgroup's registers (the grid fallback)


def swizzled(cols: int):
    """128-byte swizzle rows of `cols` 16-bit elements (the wgmma operand layout)."""
    return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(128))


def launch(make_kernel, q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config,
           interpret, dq_slices_per_cta):
    """Padded q/o/do [B, Sp, Hq, D], k/v [B, Tp, Hkv, D], lse2 [B, Hq, Sp] (log2 units) ->
    (dq, dk, dv) in the input dtype, by the kernel make_kernel(q.shape, k.shape, dtype, ...)
    builds. dq_slices_per_cta: how many dQ tiles a CTA reduce-adds per query tile (the
    interpreter's stand-in for the reduce-adds keeps a slice of dQ's buffer per tile)."""
    B, Sp, Hq, D = q.shape
    Tp = k.shape[1]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"the fused sm90 backward takes head_dim <= {MAX_HEAD_DIM}, got {D}")
    delta = softmax_delta(o, do)
    n_cta = Tp // (WGS * config.block_kv_bwd)
    if q_seg is not None:  # [B, Tp / bkv, bkv + RANGE_COLS]: each key tile's ids, then the
        # query tiles it sees (tile_ranges.py, transposed) with its CTA's union (cta_ranges)
        bkv = config.block_kv_bwd
        ranges = cta_ranges(tile_ranges(q_seg, kv_seg, rows=bkv, cols=config.block_q_bwd,
                                        causal=causal, kv_len=kv_len, transposed=True), WGS)
        kv_seg = jnp.concatenate([kv_seg.reshape(B, Tp // bkv, bkv), ranges], axis=-1)
    kernel = make_kernel(q.shape, k.shape, q.dtype, has_seg=q_seg is not None, scale=scale,
                         causal=causal, kv_len=kv_len, config=config, interpret=interpret)
    args = (q, k, v, do, lse2, delta) + ((q_seg, kv_seg) if q_seg is not None else ())

    def run(dq_acc):
        with interpret_ctx(interpret):
            return plgpu.kernel(
                kernel, out_type=(out_struct(k, k.shape, q.dtype),
                                  out_struct(v, v.shape, q.dtype)),
                grid=(k.shape[2], n_cta, B), grid_names=("heads", "kv_seq", "batch"),
                num_threads=WGS + 1, thread_name="wg",
                compiler_params=plgpu.CompilerParams(approx_math=True),
            )(*args, dq_acc)
    return reduce_added_dq(q, n_cta * dq_slices_per_cta, scale, interpret, run)


def kernel_dims(q_shape, k_shape, config):
    """(D, G, bq, bkv, n_q, steps): head dim, q heads per kv head, the backward's tiles, query
    tiles per head and the ring's depth."""
    _, Sp, Hq, D = q_shape
    G = Hq // k_shape[2]
    bq, bkv = config.block_q_bwd, config.block_kv_bwd
    n_q = Sp // bq
    return D, G, bq, bkv, n_q, min(config.max_concurrent_steps, G * n_q)


class Cta(NamedTuple):
    """Where a CTA is: batch, kv head, this warpgroup, the CTA's index along the keys, its
    first key tile (row0) and key (cta_kv), and query_range's (q_start, per_head, start)."""

    batch: Any
    kv_head: Any
    wg: Any
    cta: Any
    row0: Any
    cta_kv: Any
    q_start: Any
    per_head: Any
    start: Any


def cta_coords(kseg_smem2, *, has_seg, causal, bq, bkv, n_q) -> Cta:
    """This CTA's and warpgroup's Cta (query_range reads the range from kseg_smem2)."""
    batch, kv_head, wg = (lax.axis_index(a) for a in ("batch", "heads", "wg"))
    cta = lax.axis_index("kv_seq")
    row0 = cta * WGS  # the CTA's first key tile
    cta_kv = row0 * bkv
    return Cta(batch, kv_head, wg, cta, row0, cta_kv,
               *query_range(kseg_smem2, cta_kv, has_seg=has_seg, causal=causal, bq=bq,
                            bkv=bkv, n_q=n_q))


def consumer_start(refs, smem2, own_bars, c: Cta, *, has_seg, causal, bq, bkv, n_q, kv_len,
                   wait_other_k):
    """A consumer's start: its registers raised, its own tiles loaded and waited for
    (load_own_tiles: refs and smem2 are K's, V's and the key ids'), its mask bounds
    (mask_bounds). -> (kv_base, rows, k_seg, full, full_lo)."""
    plgpu.set_max_registers(REGS_COMPUTE, action="increase")
    kv_base, rows = load_own_tiles(
        *refs, *smem2, own_bars, batch=c.batch, kv_head=c.kv_head, wg=c.wg, row0=c.row0,
        cta_kv=c.cta_kv, bkv=bkv, wgs=WGS, has_seg=has_seg, wait_other_k=wait_other_k)
    return (kv_base, rows, *mask_bounds(
        smem2[2], wg=c.wg, kv_base=kv_base, start=c.start, has_seg=has_seg, causal=causal,
        bq=bq, bkv=bkv, n_q=n_q, kv_len=kv_len))


def query_range(kseg_smem2, cta_kv, *, has_seg, causal, bq, bkv, n_q):
    """(q_start, per_head, start): the CTA streams query tiles [q_start(w), q_start(w) +
    per_head(w)) of each q head through its ring, and both consumers run every one of them
    (w: the consumer whose SMEM row holds the range). start: the first tile without documents
    (None with them)."""
    if has_seg:  # the CTA's union (cta_ranges), behind each key tile's ids in SMEM
        q_start = lambda row: kseg_smem2[row, bkv + FIRST]
        per_head = lambda row: kseg_smem2[row, bkv + END] - kseg_smem2[row, bkv + FIRST]
        return q_start, per_head, None
    # Causal: query tile i sees keys >= base only if its last query (i+1)*bq - 1 >= base.
    start = (jnp.minimum(lax.div(cta_kv, jnp.array(bq, jnp.int32)), n_q) if causal
             else jnp.array(0, jnp.int32))
    return (lambda row: start), (lambda row: n_q - start), start


def mask_bounds(kseg_smem2, *, wg, kv_base, start, has_seg, causal, bq, bkv, n_q, kv_len):
    """-> (k_seg, full, full_lo): this consumer's key ids (documents), and the query tiles it
    runs without a mask: [full(FULL_LO), full(FULL_HI)) with documents, else [full_lo, end)."""
    k_seg = (plgpu.load(kseg_smem2.at[wg, pl.ds(0, bkv)],
                        layout=plgpu.Layout.WGMMA.reduce(1)) if has_seg else None)
    if has_seg:  # no mask on [full_lo, full_hi) of this consumer's own range
        return k_seg, (lambda c: kseg_smem2[wg, bkv + c]), None
    if causal:
        # From here on query tiles lie wholly on or below the diagonal: no mask.
        diag_end = jnp.minimum(pl.cdiv(kv_base + bkv - 1, jnp.array(bq, jnp.int32)), n_q)
    else:
        diag_end = jnp.array(0, jnp.int32)
    mask_all = kv_base + bkv > kv_len  # padded keys: masked so they stay finite
    return k_seg, None, jnp.where(mask_all, n_q, jnp.maximum(diag_end, start))


def heads_loop(step, carry, *, G, wg, q_start, per_head, full, full_lo):
    """step(i, carry, base, g, masked) over query tiles i of each q head g (the CTA's ring step
    base + i), masked where the tile needs it: decided per tile with documents (full given),
    else a masked loop then an unmasked one."""
    def head(g, carry):
        base = g * per_head(wg) - q_start(wg)
        lo, hi = q_start(wg), q_start(wg) + per_head(wg)
        if full is not None:
            def seg_step(i, carry):
                whole = (full(FULL_LO) <= i) & (i < full(FULL_HI))
                return step(i, carry, base, g, masked=jnp.logical_not(whole))
            return lax.fori_loop(lo, hi, seg_step, carry)
        carry = lax.fori_loop(lo, full_lo, lambda i, c: step(i, c, base, g, True), carry)
        return lax.fori_loop(full_lo, hi, lambda i, c: step(i, c, base, g), carry)
    return lax.fori_loop(0, G, head, carry)


def kernel_entry(body, dtype, *, has_seg, bq, bkv, D, steps, interpret, ds_smem, dq_smem,
                 dq_bars):
    """The kernel's entry: the SMEM both forms declare, in this order: (K, V, key ids, then
    the ring's Q, dO, lse2, delta, query ids), the form's dS^T tiles (ds_smem), P^T's for the
    interpreter, its dQ tiles (dq_smem); barriers (own tiles, ring, consumed) + dq_bars."""
    tx = swizzled(64)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if has_seg:
            qseg_ref, kseg_ref, dq_acc, dk_ref, dv_ref = rest
        else:
            (dq_acc, dk_ref, dv_ref), qseg_ref, kseg_ref = rest, None, None
        smem = kv_major_smem(WGS, bkv=bkv, bq=bq, D=D, steps=steps, dtype=dtype, tx=tx,
                             has_seg=has_seg) + (
            ds_smem,
            plgpu.SMEM((WGS, bkv, bq), dtype, transforms=tx) if interpret else None,
            dq_smem,
        )
        bars = kv_major_bars(WGS, steps, has_seg) + dq_bars
        pl.run_scoped(
            lambda s, b: body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref,
                              kseg_ref, dq_acc, dk_ref, dv_ref, s, b),
            smem, bars, collective_axes="wg")

    return entry
