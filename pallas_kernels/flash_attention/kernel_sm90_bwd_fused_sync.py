"""The synchronous form of the fused sm90 backward (a wait per MMA, the consumers meeting at
every step), which kernel_sm90_bwd_fused.py runs above its ASYNC_MAX_HEAD_DIM (head_dim 128):
the asynchronous form spilled there; the shipped sm90 backward at head_dim 128 (bwd_fused on
in config.py's table). Unchanged from before the asynchronous form:

Flash attention backward for Hopper (sm_90a) in FlashAttention-3's form: one kernel per
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
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..wgmma import wgmma_into as _wgmma_into
from . import kernel_sm90_bwd_fused_common as common
from .kernel_sm90_bwd_fused_common import REGS_PRODUCER, WGS
from .mosaic_common import (
    LOG2E,
    dkv_scores,
    q_producer_wg,
    ring_slot,
    store_dkv,
    unhoisted_zero,
    wgmma_zeros,
)


def _summed_wgmmas(pairs, shape):
    """sum(a @ b for (a, b) in pairs) in one fp32 accumulator (one wgmma chain, waited for)."""
    def issue(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]
    return pl.run_scoped(issue, plgpu.ACC(shape, jnp.float32))


def fused_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config,
              interpret):
    """Padded q/o/do [B, Sp, Hq, D], k/v [B, Tp, Hkv, D], lse2 [B, Hq, Sp] (log2 units) ->
    (dq, dk, dv) in the input dtype."""
    return common.launch(_kernel, q, k, v, o, lse2, do, q_seg, kv_seg, scale=scale,
                         causal=causal, kv_len=kv_len, config=config, interpret=interpret,
                         dq_slices_per_cta=1)


def _kernel(q_shape, k_shape, dtype, *, has_seg, scale, causal, kv_len, config, interpret):
    D, G, bq, bkv, n_q, steps = common.kernel_dims(q_shape, k_shape, config)
    # dQ's columns per consumer: halves where a half is whole 128-byte swizzle rows of K (the
    # wgmma B operand); at head_dim 64 (one swizzle row) the consumers take turns instead.
    split_cols = D * jnp.dtype(dtype).itemsize >= 2 * 128
    dq_cols = D // WGS if split_cols else D
    qk_scale = scale * LOG2E
    tx = common.swizzled(64)

    # `duplicates` pairs this body's first lines with kernel_sm90_bwd_fused.py's: both forms
    # take the same operands, SMEM and CTA coordinates, unpacked by name; what they share
    # beyond names is in kernel_sm90_bwd_fused_common.py.
    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, dq_acc,
             dk_ref, dv_ref, smem, bars):
        (k_smem2, v_smem2, kseg_smem2, q_smem, do_smem, lse_smem, delta_smem, qseg_smem,
         ds_smem, p_smem2, dq_smem2) = smem
        own_bars, ring_bars, consumed, ds_ready, done = bars
        c = common.cta_coords(kseg_smem2, has_seg=has_seg, causal=causal, bq=bq, bkv=bkv,
                              n_q=n_q)
        batch, kv_head, wg, cta = c.batch, c.kv_head, c.wg, c.cta
        q_start, per_head = c.q_start, c.per_head
        ring_smem = (q_smem, do_smem, lse_smem, delta_smem, qseg_smem)

        @pl.when(wg < WGS)
        def _consumer():
            # Both consumers read both K tiles (dQ): wait for both K copies, not just ours.
            kv_base, rows, k_seg, full, full_lo = common.consumer_start(
                (k_ref, v_ref, kseg_ref), (k_smem2, v_smem2, kseg_smem2), own_bars, c,
                has_seg=has_seg, causal=causal, bq=bq, bkv=bkv, n_q=n_q, kv_len=kv_len,
                wait_other_k=True)
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            dq_smem = dq_smem2.at[wg]
            col = plgpu.Layout.WGMMA.reduce(0)  # vectors along the query (column) axis
            cols = pl.ds(wg * dq_cols if split_cols else 0, dq_cols)

            def step(i, carry, base, g, masked=False):
                dk, dv = carry
                t = base + i
                slot, par = ring_slot(t, steps), ring_slot(t, 2)
                z = unhoisted_zero(t)  # K and V's descriptors rebuilt here (registers)
                k_tile, v_tile = k_smem2.at[wg + z], v_smem2.at[wg + z]
                # dP^T is issued before S^T is waited for: one wait for both
                dv, dst = dkv_scores(dv, masked, slot, (k_tile, v_tile, p_smem2.at[wg] if
                                                        interpret else None),
                                     ring_smem, ring_bars, q_tile=i, bq=bq, bkv=bkv,
                                     kv_base=kv_base, k_seg=k_seg, qk_scale=qk_scale, col=col,
                                     dtype=dtype, causal=causal, kv_len=kv_len,
                                     interpret=interpret)
                ds16 = dst.astype(dtype)
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

            dk, dv = common.heads_loop(
                step, (wgmma_zeros((bkv, D)), wgmma_zeros((bkv, D))), G=G, wg=wg,
                q_start=q_start, per_head=per_head, full=full, full_lo=full_lo)
            # The other consumer's last dQ may still read our K tile: meet before reusing it.
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
            store_dkv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, scale=scale, dtype=dtype)

        q_producer_wg(wg, WGS, (q_ref, do_ref, lse_ref, delta_ref, qseg_ref), ring_smem, ring_bars,
                      consumed, own_bars, batch=batch, kv_head=kv_head, G=G, bq=bq,
                      q_start=q_start, per_head=per_head, steps=steps, regs=REGS_PRODUCER)

    return common.kernel_entry(
        body, dtype, has_seg=has_seg, bq=bq, bkv=bkv, D=D, steps=steps, interpret=interpret,
        ds_smem=plgpu.SMEM((2, WGS, bkv, bq), dtype, transforms=tx),  # dS^T by step parity
        # dQ's tile as TMA stores it: 128-byte swizzle rows of 32 floats (bank-conflict free
        # stores from the WGMMA layout)
        dq_smem=plgpu.SMEM((WGS, bq, dq_cols), jnp.float32,
                           transforms=(plgpu.TilingTransform((8, 32)),
                                       plgpu.SwizzleTransform(128))),
        dq_bars=(plgpu.Barrier(num_arrivals=WGS, num_barriers=2),  # ds_ready, by step parity
                 plgpu.Barrier(num_arrivals=WGS)))  # done: both consumers' last dQ read
