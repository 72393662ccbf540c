"""What the Mosaic GPU attention kernels of both generations share (kernel_sm90*.py for Hopper,
kernel_sm100*.py for Blackwell): the mask value, log2 units, the interpreter switch, the causal
launch order, mask and column-slice helpers, and the grid-kernel backward the Mosaic forwards
fall back to where their own backward does not fit. One module every kernel file imports, so
no kernel file imports another (no private cross-imports, no import cycles).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..mosaic_interpret import interpret_ctx  # noqa: F401  (the kernels import it from here)
from ..wgmma import wgmma_into
from . import kernel_bwd
from .config import default_config

# Finite and small enough that (score * log2(e)) cannot overflow to -inf in float32.
MASK = -1e30
# The Mosaic kernels run the softmax in log2 units (exp2) and save the log-sum-exp in them.
LOG2E = math.log2(math.e)
# Columns per TMEM -> SMEM epilogue piece: one 128-byte swizzle tile of a bf16 output.
COLUMN_SLICE = 64


def q_block(name: str, n_blocks: int, causal: bool):
    """This CTA's query block. Causal: the last (longest: it sees the most keys) launch first,
    so the short diagonal-only blocks fill the tail of the grid instead of leaving SMs idle
    behind one long block (FlashAttention-3's scheduling)."""
    i = lax.axis_index(name)
    return n_blocks - 1 - i if causal else i


# cta_ranges' columns: what a CTA streams, [FIRST, END), and one warpgroup's own tile_ranges;
# two more of padding make a row 32 bytes, a whole TMA box.
FIRST, LO, FULL_LO, FULL_HI, HI, END = range(6)
RANGE_COLS = 8


def cta_ranges(ranges, wgs: int):
    """tile_ranges.py's [B, n_rows, 4] -> [B, n_rows, RANGE_COLS] (first, lo, full_lo,
    full_hi, hi, end, 0, 0) for kernels whose CTA runs `wgs` consecutive row tiles on consumer warpgroups fed by
    one producer (sm90): [first, end) is the union of the CTA's non-empty row ranges (the
    tiles the producer streams); an empty row's own range becomes the empty run at `first`,
    so that its warpgroup drains every streamed tile. Computed in XLA: a kernel reads each
    bound where it needs it (no arithmetic on loaded values kept live in registers)."""
    B, n, _ = ranges.shape
    r = ranges.reshape(B, n // wgs, wgs, 4)
    lo, hi = r[..., 0], r[..., 3]
    seen = lo < hi
    end = hi.max(axis=2, keepdims=True)  # empty rows have hi == 0
    first = jnp.minimum(jnp.where(seen, lo, jnp.iinfo(jnp.int32).max).min(axis=2, keepdims=True),
                        end)
    own = jnp.where(seen[..., None], r, first[..., None])
    cta = jnp.broadcast_to(jnp.concatenate([first, end], -1)[:, :, None], (B, n // wgs, wgs, 2))
    pad = jnp.zeros((B, n // wgs, wgs, RANGE_COLS - 6), ranges.dtype)
    return jnp.concatenate([cta[..., :1], own, cta[..., 1:], pad], -1).reshape(B, n, RANGE_COLS)


def masked_plain_masked(lo, full_lo, full_hi, hi, step, carry):
    """Runs carry = step(i, carry, masked) over the tiles [lo, hi) in order: masked on
    [lo, full_lo), unmasked on [full_lo, full_hi), masked again on [full_hi, hi) (packed
    documents: a tile straddles a document start, then tiles inside the query tile's document,
    then the causal diagonal or the next document). The bounds are callables, each read where a
    loop starts (a GMEM scalar is not kept live across the loops).

    Each variant of the step is emitted once: a two-pass outer loop runs the leading masked
    span and the unmasked one in pass 0, the trailing masked span in pass 1. Three loops in a
    row hold a third copy of the step: longer lowering and ptxas (the dq kernels). The bounds
    then stay live across both passes, which spills the kernels that are already at their
    register limit (sm90 forward at head_dim 256, sm100 forward and dkv: ptxas_report), so
    those keep three loops."""

    def part(p, carry):  # p = 0: [lo, full_lo) masked, [full_lo, full_hi); p = 1: [full_hi, hi)
        start = lo() + p * (full_hi() - lo())
        stop = full_lo() + p * (hi() - full_lo())
        carry = lax.fori_loop(start, stop, lambda i, c: step(i, c, True), carry)
        plain_stop = full_hi() + p * (full_lo() - full_hi())
        return lax.fori_loop(full_lo(), plain_stop, lambda i, c: step(i, c, False), carry)

    return lax.fori_loop(0, 2, part, carry)


def tile_mask(q_base, k_base, shape, *, causal, kv_len, q_seg=None, k_seg=None, q_dim=0):
    """Visibility of a [rows, cols] WGMMA tile; q_dim says which axis indexes queries. Built
    from one id vector per axis, broadcast only in the comparisons: two full-tile int32 iotas
    cost 2 x (tile / 128) registers per thread, enough to make the dkv kernel spill."""
    def ids(axis, base):
        vec = plgpu.broadcasted_iota(jnp.int32, (shape[axis],), 0,
                                     layout=plgpu.Layout.WGMMA.reduce(1 - axis))
        return vec + base
    k_dim = 1 - q_dim
    k_ids = ids(k_dim, k_base)
    mask = lax.broadcast_in_dim(k_ids < kv_len, shape, [k_dim])
    if causal:
        q_ids = ids(q_dim, q_base)
        mask &= (lax.broadcast_in_dim(k_ids, shape, [k_dim])
                 <= lax.broadcast_in_dim(q_ids, shape, [q_dim]))
    if q_seg is not None:
        mask &= (lax.broadcast_in_dim(q_seg, shape, [q_dim])
                 == lax.broadcast_in_dim(k_seg, shape, [k_dim]))
    return mask


def column_slices(d: int, width: int = COLUMN_SLICE):
    """O's columns in `width`-wide pieces: a warpgroup holding all of O in registers (D
    floats per thread: 256 at head_dim 256) spills."""
    return [pl.ds(c, min(width, d - c)) for c in range(0, d, width)]


def softmax_delta(o, do):
    """delta = rowsum(dO * O) [B, Hq, S] in float32, which every backward kernel reads."""
    return jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))


def reduce_added_dq(q, n_cta: int, scale: float, interpret: bool, run):
    """The fused backwards' dQ (kernel_sm90_bwd_fused.py, kernel_sm100_bwd.fused_bwd):
    run(dq_acc) -> (dk, dv) adds every CTA's float32 dQ tiles into dq_acc [B, S, Hq, D] by TMA
    reduce-adds. jax 0.11.2's interpreter has no TMA reduction, so there dq_acc is
    [n_cta, B, S, Hq, D], each CTA copying into its own slice, summed here. -> (dq scaled by
    the softmax scale in q's dtype, dk, dv)."""
    shape = (n_cta, *q.shape) if interpret else q.shape
    dq_acc = jax.new_ref(jnp.zeros(shape, jnp.float32))
    dk, dv = run(dq_acc)
    dq = dq_acc[...]
    if interpret:
        dq = dq.sum(axis=0)
    return (dq * scale).astype(q.dtype), dk, dv


def grid_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config, interpret):
    """A Mosaic forward's backward on the grid kernels (kernel_bwd.py) with their own tiles for
    this head_dim (the Mosaic config's 64-row ones overflow SMEM at 256), from the forward's
    log2-unit log-sum-exp."""
    tri = default_config("triton", q.shape[-1])
    grid_cfg = dataclasses.replace(config, block_q_bwd=tri.block_q_bwd,
                                   block_kv_bwd=tri.block_kv_bwd, num_warps=tri.num_warps,
                                   num_stages_bwd=tri.num_stages_bwd)
    return kernel_bwd.flash_bwd(q, k, v, o, lse2 / LOG2E, do, q_seg, kv_seg, config=grid_cfg,
                                scale=scale, causal=causal, kv_len=kv_len, interpret=interpret)


def ring_slot(t, steps):
    """The TMA ring slot of step t."""
    return lax.rem(t, jnp.array(steps, t.dtype))


def unhoisted_zero(t):
    """0, for a loop's step counter t >= 0 (below 2^30), in a form LLVM cannot fold: index an
    SMEM tile that stays put for the whole loop with `tile_ref.at[w + unhoisted_zero(t)]` and
    its wgmma descriptors (64 bits per 16-deep slice of the contraction) are rebuilt in the
    step, a few integer ops each, instead of hoisted out of the loop and held in registers
    across it. The sm90 fused backward at head_dim 128 spilled 144 B over 48 such registers
    (K's and V's tiles as S^T's and dP^T's A operands, both K tiles as dQ's B operand); ptxas
    spills them rather than rematerialise them."""
    return lax.shift_right_logical(t, jnp.array(30, t.dtype))


def ring_producer(total, steps, load, consumed, regs: int | None):
    """An sm90 backward's producer warpgroup (kernel_sm90_bwd*.py): preload `steps` tiles,
    refill a slot once every consumer released it, and wait for the last releases so no
    barrier phase is left unobserved when the CTA exits. regs: its setmaxnreg budget (None:
    the caller released its registers already)."""
    if regs is not None:
        plgpu.set_max_registers(regs, action="decrease")
    for i in range(steps):
        @pl.when(i < total)
        def _():
            load(jnp.int32(i), i)

    @pl.loop(0, jnp.maximum(total - steps, 0))
    def _(t):
        slot = ring_slot(t, steps)
        plgpu.barrier_wait(consumed.at[slot])
        load(t + steps, slot)

    @pl.loop(jnp.maximum(total - steps, 0), total)
    def _(t):
        plgpu.barrier_wait(consumed.at[ring_slot(t, steps)])


def q_ring_producer(refs, smems, ring_bars, consumed, *, batch, kv_head, G, bq, q_start,
                    per_head, steps, regs, range_ready=None):
    """The producer warpgroup of an sm90 backward that streams query tiles per key CTA
    (kernel_sm90_bwd.py's dkv kernel, kernel_sm90_bwd_fused.py): q_tile_loader's loads through
    ring_producer. range_ready: the barrier after which the CTA's query range, held in SMEM by
    the first consumer (packed documents), can be read.

    The registers go back first: the consumers' setmaxnreg.inc blocks until the producer's
    setmaxnreg.dec has returned registers to the CTA's pool (2 x 240 + 24 per thread is the
    whole pool), and the first consumer copies the range only after its increase. Waiting for
    the range before decreasing deadlocked the dkv and fused backwards with packed documents
    on an H200 (docs/performance.md, the first loan); the Mosaic GPU interpreter models no
    register pool, so only the order of these calls can be tested on a CPU."""
    load = q_tile_loader(refs, smems, ring_bars, batch=batch, kv_head=kv_head, G=G, bq=bq,
                         q_start=q_start, per_head=per_head)
    plgpu.set_max_registers(regs, action="decrease")
    if range_ready is not None:
        plgpu.barrier_wait(range_ready)
    ring_producer(G * per_head(), steps, load, consumed, None)


def load_own(own, own_bars, wg, wgs: int):
    """A consumer's own tiles, [(HBM source, SMEM destination)], copied (the i-th arriving on
    own_bars' barrier i * wgs + wg) and waited for."""
    for i, (src, dst) in enumerate(own):
        plgpu.copy_gmem_to_smem(src, dst, own_bars.at[i * wgs + wg])
    for i in range(len(own)):
        plgpu.barrier_wait(own_bars.at[i * wgs + wg])


def load_own_tiles(k_ref, v_ref, kseg_ref, k_smem2, v_smem2, kseg_smem2, own_bars, *, batch,
                   kv_head, wg, row0, cta_kv, bkv, wgs, has_seg, wait_other_k):
    """A consumer's K and V tiles (and its key tile's ids and range, with documents) into its
    SMEM, waited for, in a backward that keeps key tiles (the dkv kernel, both fused forms);
    wait_other_k: also the other consumers' K tiles (the fused synchronous form's dQ reads
    both).
    -> (kv_base, rows): its first key and its rows of K, V, dK and dV."""
    kv_base = cta_kv + wg * bkv
    rows = (batch, pl.ds(kv_base, bkv), kv_head)
    own = [(k_ref.at[rows], k_smem2.at[wg]), (v_ref.at[rows], v_smem2.at[wg])]
    if has_seg:
        own.append((kseg_ref.at[batch, row0 + wg], kseg_smem2.at[wg]))
    for i, (src, dst) in enumerate(own):
        plgpu.copy_gmem_to_smem(src, dst, own_bars.at[i * wgs + wg])
    for i in range(len(own)):
        for w in range(wgs) if (i == 0 and wait_other_k) else (wg,):
            plgpu.barrier_wait(own_bars.at[i * wgs + w])
    return kv_base, rows


def q_producer_wg(wg, wgs, refs, ring_smem, ring_bars, consumed, own_bars, *, batch, kv_head,
                  G, bq, q_start, per_head, steps, regs):
    """The producer warpgroup (wg == wgs, after the consumers) of a backward that streams
    query tiles per key CTA (the dkv kernel, the fused backward's synchronous form):
    q_ring_producer over refs (q, do, lse2, delta, query ids or None) into ring_smem, for the
    range q_start(0), per_head(0) of the first consumer's row; with documents that row is the
    first consumer's own copy (own_bars' key-id barrier)."""
    @pl.when(wg == wgs)
    def _producer_wg():
        has_seg = refs[4] is not None
        q_ring_producer(refs if has_seg else refs[:4], ring_smem, ring_bars, consumed,
                        batch=batch, kv_head=kv_head, G=G, bq=bq, q_start=lambda: q_start(0),
                        per_head=lambda: per_head(0), steps=steps, regs=regs,
                        range_ready=own_bars.at[2 * wgs] if has_seg else None)


def store_dkv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, *, scale, dtype):
    """A key CTA's epilogue: dK (times the softmax scale) and dV through its K and V tiles'
    SMEM, whose last reader is done, to HBM by TMA."""
    k_smem[...] = (dk * scale).astype(dtype)
    v_smem[...] = dv.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[rows], commit_group=False)
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[rows], commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0)


def q_tile_loader(refs, smems, ring_bars, *, batch, kv_head, G, bq, q_start, per_head):
    """load(t, slot) for a backward that streams, per key CTA, query tiles
    [q_start(), q_start() + per_head()) of each of the kv head's G q heads: step t's Q, dO,
    lse2, delta (and segment-id) tiles into ring slot `slot`. refs: (q, do, lse, delta[,
    q_seg]). The bounds are callables, read at each load (they may live in SMEM: a value
    kept in the producer's 24 registers could spill)."""
    def load(t, slot):
        g = lax.div(t, per_head())
        i = q_start() + lax.rem(t, per_head())
        head = kv_head * G + g
        rows = (batch, pl.ds(i * bq, bq), head)
        vec = (batch, head, pl.ds(i * bq, bq))
        q_ref, do_ref, lse_ref, delta_ref = refs[:4]
        srcs = [q_ref.at[rows], do_ref.at[rows], lse_ref.at[vec], delta_ref.at[vec]]
        if len(refs) > 4:
            srcs.append(refs[4].at[batch, pl.ds(i * bq, bq)])
        for src, dst, bar in zip(srcs, smems, ring_bars):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], bar.at[slot])
    return load


# --- what the sm90 backwards (kernel_sm90_bwd.py's two kernels, both fused forms) share -----
# Each helper emits the operations its callers emitted, in their order, so the SASS tables of
# docs/attention.md (launch.ptxas_report --sass) are unchanged by the sharing.

def wgmma_zeros(shape):
    """A float32 wgmma accumulator of zeros, in registers."""
    return plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), plgpu.Layout.WGMMA)


def wgmmas(pairs, shape):
    """[a @ b for (a, b) in pairs] in fp32, issued back to back and waited for once."""
    def issue(*accs):
        for acc, (a, b) in zip(accs, pairs):
            plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)
    return pl.run_scoped(issue, *(plgpu.ACC(shape, jnp.float32) for _ in pairs))


def a_operand(x16, smem, interpret: bool):
    """wgmma's A: registers on the GPU, SMEM in the interpreter (which reads A only there)."""
    if not interpret:
        return x16
    smem[...] = x16
    plgpu.commit_smem()
    return smem


def skip_slot(slot, loaded, released):
    """A ring slot this warpgroup does not compute on (loaded for the other one): wait for
    each of its loads, so every barrier phase is observed before the CTA exits, and release
    it."""
    for bar in loaded:
        plgpu.barrier_wait(bar.at[slot])
    for bar in released:
        plgpu.barrier_arrive(bar.at[slot])


def mask_scores_t(st, masked, *, q_tile, bq, kv_base, q_seg, k_seg, col, causal, kv_len):
    """S^T [bkv, bq] of key tile kv_base and query tile q_tile, masked where `masked` says:
    a Python bool at trace time, or a traced one per tile (lax.cond: one copy of the step in
    the loop, which keeps its registers). q_seg: the query ids' SMEM tile (documents) or
    None; read only where the tile is masked."""
    def mask_scores(st):
        q_ids = plgpu.load(q_seg, layout=col) if q_seg is not None else None
        mask = tile_mask(q_tile * bq, kv_base, st.shape, causal=causal, kv_len=kv_len,
                         q_seg=q_ids, k_seg=k_seg, q_dim=1)
        return jnp.where(mask, st, MASK)
    if isinstance(masked, bool):
        return mask_scores(st) if masked else st
    return lax.cond(masked, mask_scores, lambda st: st, st)


def kv_major_smem(wgs, *, bkv, bq, D, steps, dtype, tx, has_seg):
    """The SMEM a backward that keeps key tiles and streams query tiles declares first (the
    dkv kernel, both fused forms): each consumer's K and V (and its key ids with their
    range), then the ring's Q, dO, lse2, delta (and query ids)."""
    return (
        plgpu.SMEM((wgs, bkv, D), dtype, transforms=tx),
        plgpu.SMEM((wgs, bkv, D), dtype, transforms=tx),
        plgpu.SMEM((wgs, bkv + RANGE_COLS), jnp.int32) if has_seg else None,
        plgpu.SMEM((steps, bq, D), dtype, transforms=tx),
        plgpu.SMEM((steps, bq, D), dtype, transforms=tx),
        plgpu.SMEM((steps, bq), jnp.float32),
        plgpu.SMEM((steps, bq), jnp.float32),
        plgpu.SMEM((steps, bq), jnp.int32) if has_seg else None,
    )


def kv_major_bars(wgs, steps, has_seg):
    """kv_major_smem's barriers: the own tiles' (K, V, key ids per consumer), the ring's (one
    per streamed operand) and `consumed` (every consumer released a ring slot)."""
    n_own, n_ring = (3, 5) if has_seg else (2, 4)
    return (plgpu.Barrier(num_barriers=n_own * wgs),
            tuple(plgpu.Barrier(num_barriers=steps) for _ in range(n_ring)),
            plgpu.Barrier(num_arrivals=wgs, num_barriers=steps))


def load_kv_tile(srcs, dsts, bars, slot, *, batch, rows, kv_head):
    """Key tile `rows` of K and V (and, given a third source, its key ids) from HBM into SMEM
    ring slot `slot` of dsts, each copy arriving on that slot of its barrier in bars."""
    for i, (src, dst, bar) in enumerate(zip(srcs, dsts, bars)):
        at = (batch, rows) if i == 2 else (batch, rows, kv_head)
        plgpu.copy_gmem_to_smem(src.at[at], dst.at[slot], bar.at[slot])


def dkv_scores(dv, masked, slot, tiles, ring_smem, ring_bars, *, q_tile, bq, bkv, kv_base,
               k_seg, qk_scale, col, dtype, causal, kv_len, interpret):
    """The first half of a step of a backward that keeps key tiles and waits for each MMA
    (the dkv kernel, the fused backward's synchronous form), on ring slot `slot`:
    S^T = K Q^T and dP^T = V dO^T issued together and waited for once, P^T = exp2(S^T - lse2)
    (masked where `masked`), dV += P^T dO. tiles: this consumer's K and V tiles and P^T's
    SMEM (the interpreter's A operand, else None); ring_smem: the ring's Q, dO, lse2, delta
    and query-id tiles (None without documents). -> (dV, dS^T = P^T (dP^T - delta), fp32)."""
    k_tile, v_tile, p_smem = tiles
    q_smem, do_smem, lse_smem, delta_smem, qseg_smem = ring_smem
    for bar in ring_bars[:4]:
        plgpu.barrier_wait(bar.at[slot])
    st, dpt = wgmmas(((k_tile, q_smem.at[slot].transpose((1, 0))),
                      (v_tile, do_smem.at[slot].transpose((1, 0)))), (bkv, bq))
    st = st * qk_scale
    if qseg_smem is not None:
        plgpu.barrier_wait(ring_bars[4].at[slot])
    st = mask_scores_t(st, masked, q_tile=q_tile, bq=bq, kv_base=kv_base,
                       q_seg=qseg_smem.at[slot] if qseg_smem is not None else None,
                       k_seg=k_seg, col=col, causal=causal, kv_len=kv_len)
    lse = plgpu.load(lse_smem.at[slot], layout=col)
    pt = jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))
    a_p = a_operand(pt.astype(dtype), p_smem, interpret)
    dv = wgmma_into(dv, lambda acc: plgpu.wgmma(acc, a_p, do_smem.at[slot]), interpret)
    dlt = plgpu.load(delta_smem.at[slot], layout=col)
    return dv, pt * (dpt - lax.broadcast_in_dim(dlt, st.shape, [1]))
