"""Flash attention for Blackwell (sm_100a) in Pallas Mosaic GPU: TMA, tcgen05 MMAs with the
scores and the output accumulator in tensor memory (TMEM), warp-specialised (FA4-style).

A CTA owns block_q = 128 query rows of one (batch, q head): TMEM has 128 lanes, one per row,
so a softmax warpgroup of 128 threads reads a whole row per thread and its row max and sum
need no shuffles. Three warpgroups:
  load     TMA: Q once, then K and V tiles of the kv head (q head // group; GQA without
           repeating K/V) into a max_concurrent_steps-deep SMEM ring;
  mma      issues S_j = Q K_j^T into one of two TMEM score buffers, then O += P_{j-1} V_{j-1}
           into the TMEM accumulator: the tensor core computes the next scores while the
           softmax works on the current ones;
  softmax  S_j TMEM -> registers, scale (log2 domain), mask, online max/sum, rescales O in
           TMEM (after the previous PV is done, which also frees the one P buffer), writes P_j
           (bf16/fp16) to SMEM for the next PV, and at the end O / l -> HBM plus the
           log-sum-exp.
Masks: causal (tiles right of the diagonal are never loaded), padded keys (any length),
packed documents (segment ids come by TMA with barriers the softmax waits on itself), and
causal with segment ids together (packed-document training). Masked scores are a finite -1e30,
so fully masked rows give no NaNs. The backward (kernel_sm100_bwd.py) recomputes P from the
saved log-sum-exp in tcgen05 dq and dkv kernels.

Packed documents: each CTA visits only the key tiles [lo, hi) that tile_ranges.py computes in
XLA from the segment ids (read here from GMEM as scalars), so tiles before the query tile's
first document start are never loaded, and skips the mask on [full_lo, full_hi), the tiles
wholly inside its one document. All three warpgroups walk the same tiles, counted t = 0, 1, ..
from lo, so slots, buffers and barrier phases stay in step. A query tile with no key to see
(lo == hi) writes a zero output and a log-sum-exp of MASK (finite: the backward computes
exp2(s - lse)).

FlashConfig.fwd_q_tiles=2 (off until a GPU measures it) is FlashAttention-4's q_stage=2: a CTA
owns two consecutive 128-row query tiles and runs a softmax warpgroup for each (one copy of
the code, the tile index read from the warpgroup index), so the tensor core computes one
tile's S and P V while the other's softmax runs. The MMA warpgroup issues S_0,j and S_1,j for
each K/V tile, then P_0,j-1 V and P_1,j-1 V; each tile has its two score buffers and its O in
TMEM (2 x (2 x block_kv + D) columns: block_kv 64 at head_dim 128) and its P tile in SMEM.
The CTA visits the union of its tiles' key ranges (as FA4's 256-row blocks do), a key tile
outside a query tile's own range masked for it; a query tile with an empty own range writes
O = 0.

FlashConfig.fwd_exp2_fma (off until measured): the second 32-score slice of each key tile
takes its exponentials from exp2_fma, a polynomial on the FMA units, beside MUFU's (FA4's
exp2 emulation).

FlashConfig.fwd_p_tmem (off until measured): P kept in TMEM for the P V MMA (tcgen05 with its
A operand in TMEM, FA4's form) instead of SMEM: the softmax stores P_t (bf16/fp16, packed two
to a column) into one of two P buffers of its own (2 x block_kv / 2 columns; FA4 aliases
them over S, which the interpreter cannot check, see below), so writing P_t no longer waits
for P_{t-1} V: only the O rescale does. FlashConfig.fwd_correction (needs fwd_p_tmem) moves
that rescale to a fourth, correction warpgroup (FA4's): the softmax keeps its running max
unless a row's max grew by more than RESCALE_THRESHOLD = log2(256) (P then stays <= 256, and
the sum l uses the same stale max, so O / l and the log-sum-exp are exact), hands each tile's
factors (1 where the max stayed) to the correction warpgroup through SMEM, and never waits on
the tensor core inside its loop; the correction warpgroup waits for P_{t-1} V, rescales O in
TMEM only when some row's factor is not 1 (a warpgroup-wide min), and releases P_t V to the
MMA warpgroup. One query tile per CTA (fwd_q_tiles=1): 2 x block_kv + D + block_kv <= 512
TMEM columns (exactly 512 at head_dim 128).

Left for later, as FA4 does them: P aliased over S's TMEM columns, two query tiles with P in
TMEM, and a persistent tile scheduler.

Tested on CPU under the Mosaic GPU interpreter (tcgen05, TMEM, TMA, barriers) and compiled for
a B200 without a GPU (aot_test.py).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..target import out_struct
from .mosaic_common import LOG2E, MASK, column_slices, interpret_ctx, load_kv_tile, q_block
from .tile_ranges import tile_ranges

BLOCK_Q = 128  # TMEM lanes: one query row per lane
_SOFTMAX, _MMA, _LOAD, _SOFTMAX1 = 0, 1, 2, 3
_CORRECTION = 3  # fwd_correction's warpgroup (one query tile: no second softmax warpgroup)
TMEM_COLS = 512
# setmaxnreg per thread, by query tiles per CTA: 3 warpgroups start at 168 each (65536 / 384),
# 4 at 128; the load warpgroup gives up the most with two softmax warpgroups to feed
# (24 + 40 + 2 x 224 = 512).
REGS_LOAD = {1: 40, 2: 24}
REGS_MMA = 40
REGS_SOFTMAX = {1: 232, 2: 224}
REGS_CORRECTION = 96  # fwd_correction: 32-column slices of O and one factor per row
REGS_SOFTMAX_CORRECTION = 256  # beside it (40 + 40 + 96 + 256 = 432 <= 512)
# fwd_correction: a row's running max moves only when its new max exceeds it by more than
# log2(256) (scores are in log2 units), FA4's rescale threshold: P stays <= 2^8.
RESCALE_THRESHOLD = 8.0


def pad_multiples(cfg):
    """The forward's and the dq kernel's 128 query rows per CTA (fwd_q_tiles x 128 in the
    forward), the dkv kernel's 128 keys."""
    return (max(BLOCK_Q * cfg.fwd_q_tiles, cfg.block_q_bwd),
            max(cfg.block_kv, BLOCK_Q, cfg.block_kv_bwd))


RESCALE_SLICE = 32  # O columns per rescale load (TMEM only: no SMEM tile to respect)
S_SLICE = 32  # score columns per TMEM load and P store in the softmax
# 2^f on [-1/2, 1/2], degree 3 (Horner: three FMAs), fitted for relative error: at most
# 7.5e-5, against bf16 P's rounding of 2^-9 = 2e-3.
POLY_EXP2 = (0.9999280571937561, 0.6932609677314758, 0.2426111400127411, 0.055171653628349304)
_ROUND = 1.5 * 2.0 ** 23  # x + _ROUND rounds x to an integer, held in the low mantissa bits


def exp2_fma(x):
    """2^x for x <= 0 on the FMA and integer units instead of MUFU (FlashAttention-4's exp2
    emulation, FlashConfig.fwd_exp2_fma): x = n + f with n = round(x) (adding 1.5 * 2^23
    rounds to nearest) and f in [-1/2, 1/2], 2^f by POLY_EXP2, then n added into the
    exponent bits. x is clamped at -126 so that the exponent cannot underflow: 2^-126 and
    below give at most 2^-125 (hardware exp2 flushes them to 0), nothing against O."""
    x = jnp.maximum(x, -126.0)
    # The barrier keeps an algebraic simplifier from folding (x + R) - R into x (XLA's does,
    # which the interpreter runs); LLVM keeps both roundings without fast-math flags.
    xr = lax.optimization_barrier(x + _ROUND)
    f = x - (xr - _ROUND)
    c0, c1, c2, c3 = POLY_EXP2
    p = ((c3 * f + c2) * f + c1) * f + c0
    n_bits = lax.shift_left(lax.bitcast_convert_type(xr, jnp.int32), jnp.int32(23))
    return lax.bitcast_convert_type(lax.bitcast_convert_type(p, jnp.int32) + n_bits,
                                    jnp.float32)


def _rescale_o(o_tmem, alpha):
    """O *= alpha (one factor per row) in TMEM, a column slice at a time. Each slice's load
    completes (wait_load_tmem) before the store overwrites what it read."""
    for cols in column_slices(o_tmem.shape[1], RESCALE_SLICE):
        o = plgpu.async_load_tmem(o_tmem.at[:, cols])
        plgpu.wait_load_tmem()
        plgpu.async_store_tmem(o_tmem.at[:, cols], o * lax.broadcast_in_dim(alpha, o.shape, [0]))
    plgpu.commit_tmem()


def flash_fwd(q, k, v, q_seg, kv_seg, *, scale, causal, kv_len, config, interpret):
    """Padded q [B, Sp, Hq, D], k/v [B, Tp, Hkv, D] -> (out, lse2 [B, Hq, Sp] in log2 units)."""
    B, Sp, Hq, D = q.shape
    Tp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dtype = q.dtype
    block_kv = config.block_kv
    n_kv = Tp // block_kv
    steps = min(config.max_concurrent_steps, n_kv)
    has_seg = q_seg is not None
    kv_full = 0 if has_seg else kv_len // block_kv  # tiles below need no mask at all
    qk_scale = scale * LOG2E
    row = plgpu.Layout.TCGEN05.reduce(1)  # one value per query row (per TMEM lane)
    nq = config.fwd_q_tiles  # query tiles per CTA, a softmax warpgroup each
    p_tmem_on, corr = config.fwd_p_tmem, config.fwd_correction
    if p_tmem_on and (nq != 1 or 3 * block_kv + D > TMEM_COLS):
        raise ValueError(
            f"FlashConfig(fwd_p_tmem=True, fwd_q_tiles={nq}, block_kv={block_kv}) at head_dim "
            f"{D}: P in TMEM needs one query tile and two score buffers + O + two P buffers "
            f"= {3 * block_kv + D} <= {TMEM_COLS} TMEM columns")
    if nq * (2 * block_kv + D) > TMEM_COLS:
        raise ValueError(
            f"FlashConfig(fwd_q_tiles={nq}, block_kv={block_kv}) at head_dim {D}: {nq} x (two "
            f"score buffers + O) = {nq * (2 * block_kv + D)} TMEM columns, over {TMEM_COLS}; "
            f"use block_kv={(TMEM_COLS // nq - D) // 2 // 64 * 64 or 64} or fwd_q_tiles=1")

    def kernel(q_gmem, k_gmem, v_gmem, qseg_gmem, kseg_gmem, ranges_gmem, out_gmem, lse_gmem,
               q_smem, k_smem, v_smem, p_smem, lse_smem, qseg_smem, kseg_smem,
               s_tmem, o_tmem,
               q_loaded, kv_loaded, kv_free, s_ready, s_read, p_ready, pv_done,
               qseg_loaded, kseg_loaded, p_tmem=None, alpha_smem=None, alpha_ready=None,
               o_ready=None, o_done=None):
        wg = lax.axis_index("wg")
        batch, q_head = lax.axis_index("batch"), lax.axis_index("heads")
        q_tile = q_block("q_seq", Sp // (nq * BLOCK_Q), causal)  # longest first
        q_base = q_tile * (nq * BLOCK_Q)

        def own_ranges(i):
            """Query tile i's key tiles [lo, hi), [full_lo, full_hi) of them needing no mask."""
            base = q_base + i * BLOCK_Q
            if has_seg:
                return tuple(ranges_gmem[batch, q_tile * nq + i, c] for c in range(4))
            if causal:  # key tiles at or left of this block's last query
                hi = jnp.minimum(pl.cdiv(base + BLOCK_Q, jnp.int32(block_kv)), n_kv)
                full_hi = jnp.minimum(lax.div(base, jnp.int32(block_kv)), kv_full)
                return jnp.int32(0), jnp.int32(0), full_hi, hi
            return jnp.int32(0), jnp.int32(0), jnp.int32(kv_full), jnp.int32(n_kv)

        def visits():
            """The CTA visits key tiles [lo, hi), the union of its query tiles' ranges (as
            FA4's 256-row blocks do), t = j - lo; a tile outside a query tile's own range is
            masked: (lo, hi, hi - lo). Each warpgroup computes them in its own branch: values
            live across set_max_registers count against the smallest budget."""
            ranges = [own_ranges(i) for i in range(nq)]
            lo = ranges[0][0] if nq == 1 else jnp.minimum(ranges[0][0], ranges[1][0])
            hi = ranges[0][3] if nq == 1 else jnp.maximum(ranges[0][3], ranges[1][3])
            return lo, hi, hi - lo

        @pl.when(wg == _LOAD)
        def _load():
            plgpu.set_max_registers(REGS_LOAD[nq], action="decrease")
            lo, _, kv_steps = visits()
            kv_head = lax.div(q_head, jnp.int32(G))
            for i in range(nq):
                plgpu.copy_gmem_to_smem(
                    q_gmem.at[batch, pl.ds(q_base + i * BLOCK_Q, BLOCK_Q), q_head],
                    q_smem.at[i], q_loaded)
            if has_seg:
                plgpu.copy_gmem_to_smem(qseg_gmem.at[batch, pl.ds(q_base, nq * BLOCK_Q)],
                                        qseg_smem, qseg_loaded)

            @pl.loop(0, kv_steps)
            def _(t):
                slot = lax.rem(t, jnp.int32(steps))

                @pl.when(t >= steps)
                def _():  # PV of step t - steps is done: its K and V are no longer read
                    plgpu.barrier_wait(kv_free.at[slot])

                load_kv_tile((k_gmem, v_gmem) + ((kseg_gmem,) if has_seg else ()),
                             (k_smem, v_smem, kseg_smem), (kv_loaded, kv_loaded, kseg_loaded),
                             slot, batch=batch, rows=pl.ds((lo + t) * block_kv, block_kv),
                             kv_head=kv_head)

            @pl.loop(jnp.maximum(kv_steps - steps, 0), kv_steps)
            def _(j):  # observe the last frees: no barrier phase is left pending at exit
                plgpu.barrier_wait(kv_free.at[lax.rem(j, jnp.int32(steps))])

        @pl.when(wg == _MMA)
        def _mma():
            plgpu.set_max_registers(REGS_MMA, action="decrease")
            kv_steps = visits()[2]
            plgpu.barrier_wait(q_loaded)

            def pv(t, last=False):  # O_i += P_i,t V_t per query tile; frees K/V slot t
                slot = lax.rem(t, jnp.int32(steps))
                if p_tmem_on:  # A operand from TMEM: P_t in P buffer t % 2
                    pbuf = lax.rem(t, 2)
                    plgpu.barrier_wait(p_ready.at[pbuf])
                    if corr:
                        @pl.when(t >= 1)
                        def _():  # the correction warpgroup has rescaled O for tile t
                            plgpu.barrier_wait(o_ready)

                    plgpu.tcgen05_mma(o_tmem, p_tmem.at[:, pl.ds(pbuf * block_kv, block_kv)],
                                      v_smem.at[slot], accumulate=t > 0)
                    # fwd_correction: the last P V completes O for the softmax's epilogue
                    # (o_done); the others release the correction warpgroup (pv_done).
                    plgpu.tcgen05_commit_arrive(o_done if corr and last else pv_done.at[0])
                for i in range(nq if not p_tmem_on else 0):
                    plgpu.barrier_wait(p_ready.at[i])
                    plgpu.tcgen05_mma(o_tmem.at[:, pl.ds(i * D, D)], p_smem.at[i],
                                      v_smem.at[slot], accumulate=t > 0)
                    plgpu.tcgen05_commit_arrive(pv_done.at[i])
                plgpu.tcgen05_commit_arrive(kv_free.at[slot])

            @pl.loop(0, kv_steps)
            def _(j):
                slot, buf = lax.rem(j, jnp.int32(steps)), lax.rem(j, 2)
                plgpu.barrier_wait(kv_loaded.at[slot])
                for i in range(nq):  # S_i,j of each query tile, one after the other
                    @pl.when(j >= 2)
                    def _():  # softmax i has read S_i,j-2 out of this buffer
                        plgpu.barrier_wait(s_read.at[2 * i + buf])

                    plgpu.tcgen05_mma(s_tmem.at[:, pl.ds((2 * i + buf) * block_kv, block_kv)],
                                      q_smem.at[i], k_smem.at[slot].transpose((1, 0)),
                                      s_ready.at[2 * i + buf], accumulate=False)

                @pl.when(j >= 1)
                def _():
                    pv(j - 1)

            @pl.when(kv_steps > 0)
            def _():
                pv(kv_steps - 1, last=True)

            @pl.loop(jnp.maximum(kv_steps - 2, 0), kv_steps)
            def _(j):  # observe the last two reads
                for i in range(nq):
                    plgpu.barrier_wait(s_read.at[2 * i + lax.rem(j, 2)])

        def _softmax(i):
            """Softmax warpgroup of query tile i (rows q_base + i * 128 ..; i is traced when
            there are two: one copy of this code for both warpgroups, as FA3/FA4 run their
            consumers, since ptxas spilled 40 B with a copy per warpgroup)."""
            plgpu.set_max_registers(REGS_SOFTMAX_CORRECTION if corr else REGS_SOFTMAX[nq],
                                    action="increase")
            base = q_base + i * BLOCK_Q
            if has_seg:  # the segment ids have barriers of their own, waited here only
                plgpu.barrier_wait(qseg_loaded)
                q_seg = plgpu.load(qseg_smem.at[pl.ds(i * BLOCK_Q, BLOCK_Q)], layout=row)
            lo, hi, kv_steps = visits()
            own_lo, full_lo, full_hi, own_hi = own_ranges(i)
            if nq > 1:  # this tile's unmasked run, inside the CTA's range
                full_lo = jnp.clip(full_lo, lo, hi)
                full_hi = jnp.clip(full_hi, full_lo, hi)
            s_buf = s_tmem.at[:, pl.ds(i * (2 * block_kv), 2 * block_kv)]
            o_buf = o_tmem.at[:, pl.ds(i * D, D)]

            def step(j, carry, masked):  # key tile j, step t = j - lo
                m_i, l_i = carry
                t = j - lo
                buf, slot = lax.rem(t, 2), lax.rem(t, jnp.int32(steps))
                plgpu.barrier_wait(s_ready.at[2 * i + buf])
                # Every step waits for its key ids, masked or not, so that the barrier's
                # phases stay in step with the loads; read before P_t is released (the slot
                # stays loaded until then).
                if has_seg:
                    plgpu.barrier_wait(kseg_loaded.at[slot])
                # S in S_SLICE-column pieces: the key segment ids are a column vector, one
                # value per key in every thread, which next to a whole row of S spills.
                parts = []
                for c in range(0, block_kv, S_SLICE):
                    shape = (BLOCK_Q, S_SLICE)
                    s = plgpu.async_load_tmem(
                        s_buf.at[:, pl.ds(buf * block_kv + c, S_SLICE)])
                    s = s * qk_scale
                    if masked:
                        q_ids = base + plgpu.broadcasted_iota(jnp.int32, shape, 0,
                                                              layout=plgpu.Layout.TCGEN05)
                        k_ids = j * block_kv + c + plgpu.broadcasted_iota(
                            jnp.int32, shape, 1, layout=plgpu.Layout.TCGEN05)
                        mask = k_ids < kv_len
                        if causal:
                            mask &= k_ids <= q_ids
                        if has_seg:
                            k_seg = plgpu.load(kseg_smem.at[slot, pl.ds(c, S_SLICE)],
                                               layout=plgpu.Layout.TCGEN05.reduce(0))
                            mask &= (lax.broadcast_in_dim(q_seg, shape, [0])
                                     == lax.broadcast_in_dim(k_seg, shape, [1]))
                        s = jnp.where(mask, s, MASK)
                    parts.append(s)
                plgpu.wait_load_tmem()
                plgpu.barrier_arrive(s_read.at[2 * i + buf])
                m_new = m_i
                for s in parts:
                    m_new = jnp.maximum(m_new, s.max(axis=1))
                if corr:  # FA4: keep the stale max unless it moved by more than 8 (log2 256)
                    m_new = jnp.where(m_new - m_i > RESCALE_THRESHOLD, m_new, m_i)
                alpha = jnp.exp2(m_i - m_new)
                # fwd_exp2_fma: slice 1 on the FMA units, the rest on MUFU (FA4 starts its
                # emulation at fragment 1 too); a second slice spilled (32-72 B, ptxas).
                parts = [(exp2_fma if k == 1 and config.fwd_exp2_fma else jnp.exp2)(
                    s - lax.broadcast_in_dim(m_new, s.shape, [0])) for k, s in enumerate(parts)]
                l_i = l_i * alpha
                for p in parts:
                    l_i = l_i + p.sum(axis=1)
                # bf16 P across the O rescale: half the registers of float32 P.
                parts = [p.astype(dtype) for p in parts]
                if p_tmem_on:
                    pbuf = lax.rem(t, 2)  # P_t over P_{t-2}: S_t's s_ready, committed after
                    # P_{t-2} V was issued, tracks that MMA's completion too (tcgen05.commit)
                    for c, p in zip(range(0, block_kv, S_SLICE), parts):
                        plgpu.async_store_tmem(
                            p_tmem.at[:, pl.ds(pbuf * block_kv + c, S_SLICE)], p)
                    if corr:  # the factors to the correction warpgroup; no tensor-core wait
                        alpha_smem.at[pbuf][...] = alpha

                        @pl.when(t >= 1)
                        def _():
                            plgpu.barrier_arrive(alpha_ready.at[pbuf])
                    else:
                        @pl.when(t >= 1)
                        def _():  # PV_{t-1} is done: O is complete up to t-1
                            plgpu.barrier_wait(pv_done.at[i])
                            _rescale_o(o_buf, alpha)
                    plgpu.commit_tmem()
                    plgpu.barrier_arrive(p_ready.at[pbuf])
                    return m_new, l_i

                @pl.when(t >= 1)
                def _():  # PV_{t-1} is done: O is complete up to t-1, and P may be rewritten
                    plgpu.barrier_wait(pv_done.at[i])
                    _rescale_o(o_buf, alpha)

                for c, p in zip(range(0, block_kv, S_SLICE), parts):
                    p_smem.at[i, :, pl.ds(c, S_SLICE)][...] = p
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready.at[i])
                return m_new, l_i

            m_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), MASK, jnp.float32), row)
            l_i = plgpu.layout_cast(jnp.full((BLOCK_Q,), 0.0, jnp.float32), row)
            carry = (m_i, l_i)
            if has_seg or nq > 1:  # masked up to the tile's own document (or range)
                carry = lax.fori_loop(lo, full_lo, lambda j, c: step(j, c, True), carry)
            carry = lax.fori_loop(full_lo, full_hi, lambda j, c: step(j, c, False), carry)
            m_i, l_i = lax.fori_loop(full_hi, hi, lambda j, c: step(j, c, True), carry)

            @pl.when(kv_steps > 0)
            def _():
                plgpu.barrier_wait(o_done if corr else pv_done.at[i])  # the last PV

            if has_seg or nq > 1:
                @pl.when(own_hi <= own_lo)
                def _():  # no key to see: O = 0 (TMEM holds whatever was there before, or
                    # P V of the other tile's keys, all masked for this one: its log-sum-exp
                    # is MASK already, MASK + log2(count) rounding to MASK), and Q's copy
                    # (when no MMA waited for it) lands before O overwrites it
                    plgpu.barrier_wait(q_loaded)
                    for cols in column_slices(D, RESCALE_SLICE):
                        plgpu.async_store_tmem(o_buf.at[:, cols], plgpu.layout_cast(
                            jnp.zeros((BLOCK_Q, RESCALE_SLICE), jnp.float32),
                            plgpu.Layout.TCGEN05))
                    plgpu.commit_tmem()

            l_safe = jnp.where(l_i == 0.0, 1.0, l_i)  # padded query rows of an empty tile
            for cols in column_slices(D):  # O / l a slice at a time: D/4 floats per thread
                o = plgpu.async_load_tmem(o_buf.at[:, cols])
                plgpu.wait_load_tmem()
                q_smem.at[i, :, cols][...] = (o / lax.broadcast_in_dim(l_safe, o.shape, [0])
                                              ).astype(dtype)
            lse_smem.at[i][...] = m_i + jnp.log2(l_safe)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[i],
                                    out_gmem.at[batch, pl.ds(base, BLOCK_Q), q_head])
            plgpu.copy_smem_to_gmem(lse_smem.at[i],
                                    lse_gmem.at[batch, q_head, pl.ds(base, BLOCK_Q)])
            plgpu.wait_smem_to_gmem(0)

        if corr:
            @pl.when(wg == _CORRECTION)
            def _correction():
                """FA4's correction warpgroup: for tile t >= 1, once P_{t-1} V is done, O *=
                the softmax's factors for t, skipped when all 128 are 1 (no row's max moved
                by more than RESCALE_THRESHOLD); then P_t V may be issued (o_ready)."""
                plgpu.set_max_registers(REGS_CORRECTION, action="decrease")
                kv_steps = visits()[2]

                @pl.loop(1, jnp.maximum(kv_steps, 1))
                def _(t):
                    pbuf = lax.rem(t, 2)
                    plgpu.barrier_wait(alpha_ready.at[pbuf])
                    plgpu.barrier_wait(pv_done.at[0])  # P_{t-1} V
                    alpha = plgpu.load(alpha_smem.at[pbuf], layout=row)

                    @pl.when(alpha.min() < 1.0)
                    def _():
                        _rescale_o(o_tmem, alpha)

                    plgpu.barrier_arrive(o_ready)

        if nq == 1:
            pl.when(wg == _SOFTMAX)(lambda: _softmax(0))
        else:
            pl.when((wg == _SOFTMAX) | (wg == _SOFTMAX1))(
                lambda: _softmax(jnp.where(wg == _SOFTMAX1, 1, 0)))

    swizzle = plgpu.find_swizzle(D * jnp.dtype(dtype).itemsize * 8)
    tx = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))
    # P's swizzle spans S_SLICE columns: the softmax stores it a slice at a time.
    p_swizzle = plgpu.find_swizzle(min(block_kv, S_SLICE) * jnp.dtype(dtype).itemsize * 8)
    p_tx = (plgpu.TilingTransform((8, p_swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(p_swizzle))
    tc = dict(orders_tensor_core=True)
    scratch = dict(
        q_smem=plgpu.SMEM((nq, BLOCK_Q, D), dtype, transforms=tx),  # Q, then the output
        k_smem=plgpu.SMEM((steps, block_kv, D), dtype, transforms=tx),
        v_smem=plgpu.SMEM((steps, block_kv, D), dtype, transforms=tx),
        p_smem=None if p_tmem_on else plgpu.SMEM((nq, BLOCK_Q, block_kv), dtype,
                                                 transforms=p_tx),
        lse_smem=plgpu.SMEM((nq, BLOCK_Q), jnp.float32),
        qseg_smem=plgpu.SMEM((nq * BLOCK_Q,), jnp.int32) if has_seg else None,
        kseg_smem=plgpu.SMEM((steps, block_kv), jnp.int32) if has_seg else None,
        # Per query tile: two score buffers and the O accumulator (tile i's columns).
        s_tmem=plgpu.TMEM((BLOCK_Q, nq * 2 * block_kv), jnp.float32),
        o_tmem=plgpu.TMEM((BLOCK_Q, nq * D), jnp.float32),
        q_loaded=plgpu.Barrier(num_arrivals=nq),
        kv_loaded=plgpu.Barrier(num_arrivals=2, num_barriers=steps),  # K and V
        kv_free=plgpu.Barrier(num_barriers=steps, **tc),
        s_ready=plgpu.Barrier(num_barriers=2 * nq, **tc),
        # Arrived by the softmax after TMEM reads/writes, waited by the MMA issuer: tensor-core
        # ordered so the tcgen05 fences go around them.
        s_read=plgpu.Barrier(num_barriers=2 * nq, **tc),
        # fwd_p_tmem: one per P buffer (the softmax may store P_t before P_{t-1} V is issued)
        p_ready=plgpu.Barrier(num_barriers=2 if p_tmem_on else nq, **tc),
        pv_done=plgpu.Barrier(num_barriers=nq, **tc),
        qseg_loaded=plgpu.Barrier() if has_seg else None,
        kseg_loaded=plgpu.Barrier(num_barriers=steps) if has_seg else None,
        # fwd_p_tmem: two P buffers, packed two values to a TMEM column (the tcgen05 A layout)
        p_tmem=plgpu.TMEM((BLOCK_Q, 2 * block_kv), dtype, packed=True) if p_tmem_on else None,
        # fwd_correction: the softmax's factors per tile (two buffers), its signal, the
        # correction warpgroup's release of P_t V, and the last P V's completion
        alpha_smem=plgpu.SMEM((2, BLOCK_Q), jnp.float32) if corr else None,
        alpha_ready=plgpu.Barrier(num_barriers=2) if corr else None,
        o_ready=plgpu.Barrier(**tc) if corr else None,
        o_done=plgpu.Barrier(**tc) if corr else None,
    )
    scratch = {k_: v_ for k_, v_ in scratch.items() if v_ is not None}

    def entry(q_gmem, k_gmem, v_gmem, *rest, **scratch_refs):
        if has_seg:
            qseg_gmem, kseg_gmem, ranges_gmem, out_gmem, lse_gmem = rest
        else:
            (out_gmem, lse_gmem), qseg_gmem, kseg_gmem, ranges_gmem = rest, None, None, None
        refs = {"qseg_smem": None, "kseg_smem": None, "qseg_loaded": None,
                "kseg_loaded": None, "p_smem": None, **scratch_refs}
        kernel(q_gmem, k_gmem, v_gmem, qseg_gmem, kseg_gmem, ranges_gmem, out_gmem, lse_gmem,
               **refs)

    out_type = (out_struct(q, q.shape, dtype), out_struct(q, (B, Hq, Sp), jnp.float32))
    args = (q, k, v)
    if has_seg:  # [B, Sp / 128, 4]: the key tiles each query tile visits (tile_ranges.py)
        args += (q_seg, kv_seg, tile_ranges(q_seg, kv_seg, rows=BLOCK_Q, cols=block_kv,
                                            causal=causal, kv_len=kv_len))
    with interpret_ctx(interpret):
        return plgpu.kernel(
            entry, out_type=out_type, scratch_types=scratch,
            grid=(Hq, Sp // (nq * BLOCK_Q), B), grid_names=("heads", "q_seq", "batch"),
            num_threads=2 + nq + corr, thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
        )(*args)
