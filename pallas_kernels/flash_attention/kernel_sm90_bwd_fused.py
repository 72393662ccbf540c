"""Flash attention backward for Hopper (sm_90a) in FlashAttention-3's form: one kernel per
(kv tile, kv head, batch) computes dK and dV in registers and adds dQ into a float32 buffer
with TMA reduce-adds (FlashConfig.bwd_fused; kernel_sm90_bwd.py's two FA2-style kernels stay
the default until a GPU measures both).

A CTA owns 2 x block_kv_bwd keys: each of two consumer warpgroups keeps its 64-key K and V
tiles in SMEM and its dK, dV accumulators in registers; a producer warpgroup streams the Q, dO,
lse2 and delta tiles (and segment ids) of all G q heads of the kv head through a TMA ring.
Per query tile, in each consumer w:

    S^T = K_w Q^T, dP^T = V_w dO^T       (issued together, waited for once)
    P^T = exp2(S^T - lse2)               dV_w += P^T dO
    dS^T = P^T (dP^T - delta)            to SMEM (bf16), then  dK_w += dS^T Q
    -- both consumers' dS^T are in SMEM (an mbarrier both arrive on) --
    dQ[:, half w] = dS_0 K_0[:, half w] + dS_1 K_1[:, half w]
                                         to SMEM (fp32), TMA reduce-add into dQ's buffer

so each matmul unit runs once per tile (5 against the split kernels' 7: S and dP are not
recomputed), and dQ's reduction traffic is one fp32 [block_q, D] tile per (query tile, CTA),
split between the warpgroups by columns as FA3 splits it (at head_dim 64, one swizzle row,
the consumers instead take turns: all of dQ on alternate steps). dS^T is double-buffered by step
parity: a consumer writes step t+1's tile while the other may still read step t's, and cannot
reach step t+2 before the other arrived at t+1.

Causal and packed documents: both consumers visit the CTA's union of query tiles (each step
needs both dS^T tiles); a tile outside a consumer's own range runs masked, so it adds zeros.
GQA sums the G heads in the accumulators. head_dim 64 and 128, with 0 spills at 240 registers
(`python -m launch.ptxas_report --sm90-bwd-fused`): the SMEM tiles that stay put for the whole
loop (K and V, both consumers' K for dQ) are indexed through mosaic_common.unhoisted_zero, so
their wgmma descriptors are rebuilt per step rather than held in 48 registers across the loop
(144 B of spills at 128 before, and S^T and dP^T could not be issued together there). At 256
the dK and dV accumulators do not fit a warpgroup's registers (the grid fallback).

Interpreter (CPU): jax 0.11.2's Mosaic GPU interpreter has no TMA reduction. There each CTA
copies its dQ columns into its own slice of a [CTAs, B, S, Hq, D] buffer (zeros where it adds
nothing) that XLA then sums, so everything but the reduction op itself runs as compiled; and
P^T and dS^T reach wgmma through SMEM, as in kernel_sm90_bwd.py.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..target import out_struct
from ..wgmma import wgmma_into as _wgmma_into
from .mosaic_common import (
    END,
    FIRST,
    FULL_HI,
    FULL_LO,
    LOG2E,
    MASK,
    RANGE_COLS,
    cta_ranges,
    interpret_ctx,
    q_ring_producer,
    reduce_added_dq,
    ring_slot,
    softmax_delta,
    store_dkv,
    tile_mask,
    unhoisted_zero,
)
from .tile_ranges import tile_ranges

WGS = 2  # consumer warpgroups: each owns block_kv_bwd keys and half of dQ's columns
# setmaxnreg as kernel_sm90_bwd.py: 2 x 240 + 24 spends the 168 per thread the CTA starts with.
REGS_COMPUTE, REGS_PRODUCER = 240, 24
MAX_HEAD_DIM = 128


def _tx(cols: int):
    """128-byte swizzle rows of `cols` 16-bit elements (the wgmma operand layout)."""
    return (plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(128))



def _zeros(shape):
    return plgpu.layout_cast(jnp.full(shape, 0, jnp.float32), plgpu.Layout.WGMMA)


def _wgmmas(pairs, shape):
    """[a @ b for (a, b) in pairs] in fp32, issued back to back and waited for once."""
    def issue(*accs):
        for acc, (a, b) in zip(accs, pairs):
            plgpu.wgmma(acc, a, b)
        return tuple(acc[...] for acc in accs)
    return pl.run_scoped(issue, *(plgpu.ACC(shape, jnp.float32) for _ in pairs))


def _summed_wgmmas(pairs, shape):
    """sum(a @ b for (a, b) in pairs) in one fp32 accumulator (one wgmma chain, waited for)."""
    def issue(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(issue, plgpu.ACC(shape, jnp.float32))


def _a_operand(x16, smem, interpret: bool):
    """wgmma's A: registers on the GPU, SMEM in the interpreter (which reads A only there)."""
    if not interpret:
        return x16
    smem[...] = x16
    plgpu.commit_smem()
    return smem




def fused_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config,
              interpret):
    """Padded q/o/do [B, Sp, Hq, D], k/v [B, Tp, Hkv, D], lse2 [B, Hq, Sp] (log2 units) ->
    (dq, dk, dv) in the input dtype."""
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
    kernel = _kernel(q.shape, k.shape, q.dtype, has_seg=q_seg is not None, scale=scale,
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
    return reduce_added_dq(q, n_cta, scale, interpret, run)


def _kernel(q_shape, k_shape, dtype, *, has_seg, scale, causal, kv_len, config, interpret):
    B, Sp, Hq, D = q_shape
    Hkv = k_shape[2]
    G = Hq // Hkv
    bq, bkv = config.block_q_bwd, config.block_kv_bwd
    n_q = Sp // bq
    # dQ's columns per consumer: halves where a half is whole 128-byte swizzle rows of K (the
    # wgmma B operand); at head_dim 64 (one swizzle row) the consumers take turns instead.
    split_cols = D * jnp.dtype(dtype).itemsize >= 2 * 128
    dq_cols = D // WGS if split_cols else D
    steps = min(config.max_concurrent_steps, G * n_q)
    qk_scale = scale * LOG2E
    i32 = lambda x: jnp.array(x, jnp.int32)
    tx = _tx(64)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, dq_acc,
             dk_ref, dv_ref, smem, bars):
        batch, kv_head, wg = (lax.axis_index(a) for a in ("batch", "heads", "wg"))
        cta = lax.axis_index("kv_seq")
        (k_smem2, v_smem2, kseg_smem2, q_smem, do_smem, lse_smem, delta_smem, qseg_smem,
         ds_smem, p_smem2, dq_smem2) = smem
        own_bars, ring_bars, consumed, ds_ready, done = bars
        row0 = cta * WGS  # the CTA's first key tile
        cta_kv = row0 * bkv
        # Query tiles [q_start, q_start + per_head) stream through the ring for each q head;
        # both consumers run every one of them.
        if has_seg:  # the CTA's union (cta_ranges), behind each key tile's ids in SMEM
            q_start = lambda row: kseg_smem2[row, bkv + FIRST]
            per_head = lambda row: kseg_smem2[row, bkv + END] - kseg_smem2[row, bkv + FIRST]
        else:
            # Causal: query tile i sees keys >= base only if its last query (i+1)*bq - 1 >= base.
            start = jnp.minimum(lax.div(cta_kv, i32(bq)), n_q) if causal else i32(0)
            q_start = lambda row: start
            per_head = lambda row: n_q - start

        @pl.when(wg < WGS)
        def _consumer():
            plgpu.set_max_registers(REGS_COMPUTE, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            dq_smem = dq_smem2.at[wg]
            kv_base = cta_kv + wg * bkv
            rows = (batch, pl.ds(kv_base, bkv), kv_head)
            own = [(k_ref.at[rows], k_smem), (v_ref.at[rows], v_smem)]
            if has_seg:
                own.append((kseg_ref.at[batch, row0 + wg], kseg_smem2.at[wg]))
            for i, (src, dst) in enumerate(own):
                plgpu.copy_gmem_to_smem(src, dst, own_bars.at[i * WGS + wg])
            # Both consumers read both K tiles (dQ): wait for both K copies, not just ours.
            for i in range(len(own)):
                for w in range(WGS) if i == 0 else (wg,):
                    plgpu.barrier_wait(own_bars.at[i * WGS + w])
            col = plgpu.Layout.WGMMA.reduce(0)  # vectors along the query (column) axis
            k_seg = (plgpu.load(kseg_smem2.at[wg, pl.ds(0, bkv)],
                                layout=plgpu.Layout.WGMMA.reduce(1)) if has_seg else None)
            if has_seg:  # no mask on [full_lo, full_hi) of this consumer's own range
                full = lambda c: kseg_smem2[wg, bkv + c]
            else:
                if causal:
                    # From here on query tiles lie wholly on or below the diagonal: no mask.
                    diag_end = jnp.minimum(pl.cdiv(kv_base + bkv - 1, i32(bq)), n_q)
                else:
                    diag_end = i32(0)
                mask_all = kv_base + bkv > kv_len  # padded keys: masked so they stay finite
                full_lo = jnp.where(mask_all, n_q, jnp.maximum(diag_end, start))
            q_bar, do_bar, lse_bar, delta_bar = ring_bars[:4]
            qseg_bar = ring_bars[4] if has_seg else None
            cols = pl.ds(wg * dq_cols if split_cols else 0, dq_cols)

            def step(i, carry, base, g, masked=False):
                dk, dv = carry
                t = base + i
                slot, par = ring_slot(t, steps), ring_slot(t, 2)
                z = unhoisted_zero(t)  # K and V's descriptors rebuilt here (registers)
                k_tile, v_tile = k_smem2.at[wg + z], v_smem2.at[wg + z]
                for bar in (q_bar, do_bar, lse_bar, delta_bar):
                    plgpu.barrier_wait(bar.at[slot])
                # dP^T is issued before S^T is waited for: one wait for both
                st, dpt = _wgmmas(((k_tile, q_smem.at[slot].transpose((1, 0))),
                                   (v_tile, do_smem.at[slot].transpose((1, 0)))), (bkv, bq))
                st = st * qk_scale
                if has_seg:
                    plgpu.barrier_wait(qseg_bar.at[slot])

                def mask_scores(st):
                    q_seg = plgpu.load(qseg_smem.at[slot], layout=col) if has_seg else None
                    mask = tile_mask(i * bq, kv_base, (bkv, bq), causal=causal, kv_len=kv_len,
                                     q_seg=q_seg, k_seg=k_seg, q_dim=1)
                    return jnp.where(mask, st, MASK)
                if isinstance(masked, bool):
                    st = mask_scores(st) if masked else st
                else:  # decided per tile: one copy of the step in the loop (registers)
                    st = lax.cond(masked, mask_scores, lambda st: st, st)
                lse = plgpu.load(lse_smem.at[slot], layout=col)
                pt = jnp.exp2(st - lax.broadcast_in_dim(lse, st.shape, [1]))
                a_p = _a_operand(pt.astype(dtype), p_smem2.at[wg] if interpret else None,
                                 interpret)
                dv = _wgmma_into(dv, lambda acc: plgpu.wgmma(acc, a_p, do_smem.at[slot]),
                                 interpret)
                dlt = plgpu.load(delta_smem.at[slot], layout=col)
                ds16 = (pt * (dpt - lax.broadcast_in_dim(dlt, st.shape, [1]))).astype(dtype)
                ds_smem.at[par, wg][...] = ds16
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[par])
                a_ds = ds_smem.at[par, wg] if interpret else ds16
                dk = _wgmma_into(dk, lambda acc: plgpu.wgmma(acc, a_ds, q_smem.at[slot]),
                                 interpret)
                plgpu.barrier_arrive(consumed.at[slot])  # Q and dO read: the slot is free
                plgpu.barrier_wait(ds_ready.at[par])

                def add_dq():
                    # Both consumers' dS (their dS^T tiles, transposed) times K, over dQ's
                    # columns `cols`, added into dQ's buffer.
                    dq = _summed_wgmmas([(ds_smem.at[par, w].transpose((1, 0)),
                                          k_smem2.at[w + z, :, cols]) for w in range(WGS)],
                                        (bq, dq_cols))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add read it
                    dq_smem[...] = dq
                    plgpu.commit_smem()
                    head = kv_head * G + g
                    if interpret:  # this CTA's own slice; XLA sums the CTAs
                        dst = dq_acc.at[cta, batch, pl.ds(i * bq, bq), head, cols]
                        plgpu.copy_smem_to_gmem(dq_smem, dst)
                    else:
                        dst = dq_acc.at[batch, pl.ds(i * bq, bq), head, cols]
                        plgpu.copy_smem_to_gmem(dq_smem, dst, reduction_op="add")
                if split_cols:
                    add_dq()
                else:  # the consumers take turns: all of dQ on even steps in one, odd in the other
                    pl.when(par == wg)(add_dq)
                return dk, dv

            def head(g, carry):
                # Query tile i of head g is the CTA's ring step base + i.
                base = g * per_head(wg) - q_start(wg)
                lo, hi = q_start(wg), q_start(wg) + per_head(wg)
                if has_seg:
                    def seg_step(i, carry):
                        whole = (full(FULL_LO) <= i) & (i < full(FULL_HI))
                        return step(i, carry, base, g, masked=jnp.logical_not(whole))
                    return lax.fori_loop(lo, hi, seg_step, carry)
                carry = lax.fori_loop(lo, full_lo, lambda i, c: step(i, c, base, g, True),
                                      carry)
                return lax.fori_loop(full_lo, hi, lambda i, c: step(i, c, base, g), carry)

            dk, dv = lax.fori_loop(0, G, head, (_zeros((bkv, D)), _zeros((bkv, D))))
            # The other consumer's last dQ may still read our K tile: meet before reusing it.
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
            store_dkv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, scale=scale, dtype=dtype)

        @pl.when(wg == WGS)
        def _producer_wg():
            refs = (q_ref, do_ref, lse_ref, delta_ref) + ((qseg_ref,) if has_seg else ())
            # With documents, the first consumer's copy holds the CTA's range too.
            q_ring_producer(refs, (q_smem, do_smem, lse_smem, delta_smem, qseg_smem),
                            ring_bars, consumed, batch=batch, kv_head=kv_head, G=G, bq=bq,
                            q_start=lambda: q_start(0), per_head=lambda: per_head(0),
                            steps=steps, regs=REGS_PRODUCER,
                            range_ready=own_bars.at[2 * WGS] if has_seg else None)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if has_seg:
            qseg_ref, kseg_ref, dq_acc, dk_ref, dv_ref = rest
        else:
            (dq_acc, dk_ref, dv_ref), qseg_ref, kseg_ref = rest, None, None
        smem = (
            plgpu.SMEM((WGS, bkv, D), dtype, transforms=tx),
            plgpu.SMEM((WGS, bkv, D), dtype, transforms=tx),
            plgpu.SMEM((WGS, bkv + RANGE_COLS), jnp.int32) if has_seg else None,
            plgpu.SMEM((steps, bq, D), dtype, transforms=tx),
            plgpu.SMEM((steps, bq, D), dtype, transforms=tx),
            plgpu.SMEM((steps, bq), jnp.float32),
            plgpu.SMEM((steps, bq), jnp.float32),
            plgpu.SMEM((steps, bq), jnp.int32) if has_seg else None,
            plgpu.SMEM((2, WGS, bkv, bq), dtype, transforms=tx),  # dS^T by step parity
            plgpu.SMEM((WGS, bkv, bq), dtype, transforms=tx) if interpret else None,
            # dQ's tile as TMA stores it: 128-byte swizzle rows of 32 floats (bank-conflict
            # free stores from the WGMMA layout)
            plgpu.SMEM((WGS, bq, dq_cols), jnp.float32,
                       transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
        )
        n_own, n_ring = (3, 5) if has_seg else (2, 4)
        bars = (plgpu.Barrier(num_barriers=n_own * WGS),
                tuple(plgpu.Barrier(num_barriers=steps) for _ in range(n_ring)),
                plgpu.Barrier(num_arrivals=WGS, num_barriers=steps),
                plgpu.Barrier(num_arrivals=WGS, num_barriers=2),
                plgpu.Barrier(num_arrivals=WGS))
        pl.run_scoped(
            lambda s, b: body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref,
                              kseg_ref, dq_acc, dk_ref, dv_ref, s, b),
            smem, bars, collective_axes="wg")

    return entry
