"""Flash attention backward for Hopper (sm_90a) in FlashAttention-3's asynchronous form
(hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp): one kernel per (kv tile, kv head, batch) computes
dK and dV in registers and adds dQ into a float32 buffer with TMA reduce-adds
(FlashConfig.bwd_fused: the shipped sm90 backward at head_dim 64 and 128 by the SASS audit's
static bound, kernel_sm90_bwd.py's two FA2-style kernels its A/B alternative until a GPU
measures both). Head dims up to ASYNC_MAX_HEAD_DIM (64); above it (128) the synchronous form
before this one, kernel_sm90_bwd_fused_sync.py, runs instead (docs/attention.md, "sm90 fused
backward": at 128 this form spills).

A CTA owns 2 x block_kv_bwd keys: each of two consumer warpgroups keeps its 64-key K and V
tiles in SMEM and its dK, dV accumulators in registers; a producer warpgroup streams the Q, dO,
lse2 and delta tiles (and segment ids) of all G q heads of the kv head through a TMA ring, and
adds the consumers' dQ tiles into dQ's buffer. Per query tile, in each consumer w, five MMAs
and three waits:

    S^T = K_w Q^T, dP^T = V_w dO^T       issued together; S^T waited for alone
    P^T = exp2(S^T scale log2 e - lse2)  while dP^T runs
    dV_w += P^T dO                       issued; dP^T waited for alone
    dS^T = P^T (dP^T - delta)            while dV runs; to SMEM (bf16)
    dK_w += dS^T Q, dQ_w = dS_w K_w      issued; dV, dK and dQ waited for once
    dQ_w to SMEM (fp32)                  the producer reduce-adds it into dQ's buffer by TMA

so each matmul unit runs once per tile (5 against the split kernels' 7: S and dP are not
recomputed). Each consumer's dQ takes only its own dS and K, so there is no barrier between the
consumers (two fp32 [block_q, D] reduce-adds per query tile and CTA, where sharing dS^T
through SMEM took one but met at an mbarrier every step): they are coupled only through the
shared ring, which the producer refills once both released a slot, so one runs up to about a
step ahead of the other. Nor do they wait for the reduction (the producer's; dq_full /
dq_empty hand the tile over, see dq_producer for why no order of waits deadlocks).

Causal and packed documents: both consumers visit the CTA's union of query tiles (the ring's
tiles are shared); a tile outside a consumer's own range runs masked, so it adds zeros. GQA sums
the G heads in the accumulators. 0 spills at 240 registers (`python -m launch.ptxas_report
--sm90-bwd-fused`): the SMEM tiles that stay put for the whole loop are indexed through
mosaic_common.unhoisted_zero, so their wgmma descriptors and addresses are rebuilt per step
rather than held in registers across the loop; dV and dK accumulate in place (run_state) and
each other accumulator is made where its chain issues (see `chain`).

Interpreter (CPU): jax 0.11.2's Mosaic GPU interpreter has no TMA reduction, no run_state and
reads wgmma's A from SMEM only. There each (CTA, consumer) copies its dQ tiles into its own
slice of a [CTAs x 2, B, S, Hq, D] buffer (zeros where it adds nothing) that XLA then sums,
P^T reaches dV's wgmma through SMEM, and dV, dK's chains run on zero accumulators, added after:
the same arithmetic up to float32 rounding order.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import kernel_sm90_bwd_fused_common as common
from . import kernel_sm90_bwd_fused_sync as fused_sync
from .kernel_sm90_bwd_fused_common import REGS_PRODUCER, WGS
from .mosaic_common import (
    LOG2E,
    a_operand,
    mask_scores_t,
    q_tile_loader,
    ring_slot,
    store_dkv,
    unhoisted_zero,
    wgmma_zeros,
)

# Head dims this asynchronous form runs at; above, kernel_sm90_bwd_fused_sync.py (the form
# before, a wait per MMA). At 128 it spills 256 B (272 with segment ids) and ptxas serializes
# every wgmma: beside dK and dV a consumer has room for two 32-register tiles, and ptxas placed
# S^T over dK; no ordering tried avoided it (docs/attention.md, "sm90 fused backward").
ASYNC_MAX_HEAD_DIM = 64


def dq_producer(load, consumed, dq_empty, add_dq, *, total, steps, regs, range_ready=None):
    """The producer warpgroup: q_tile_loader's ring (mosaic_common.ring_producer's order) and,
    per step t, add_dq(t): wait for each consumer's dQ tile, reduce-add it into dQ's buffer
    by TMA and free it (dq_empty) once read; the consumers never wait for the reduction.

    The registers go back first (mosaic_common.q_ring_producer: the consumers' setmaxnreg.inc
    waits for them; range_ready, with documents, is filled by a consumer after its increase).
    Deadlock-free by the order of the waits: the producer's step t waits for step t's
    `consumed` and dQ tiles, which a consumer's step t makes needing only the ring's step t
    tiles (loaded by step t - steps) and dq_empty from step t - 1 (primed for step 0; each
    consumer waits for the last one after its loop, so no phase goes unobserved); no barrier
    runs more than one phase ahead of its waiter."""
    plgpu.set_max_registers(regs, action="decrease")
    if range_ready is not None:
        plgpu.barrier_wait(range_ready)
    n = total()
    for i in range(steps):
        @pl.when(i < n)
        def _():
            load(jnp.int32(i), i)

    for w in range(WGS):  # both dQ tiles start free
        plgpu.barrier_arrive(dq_empty.at[w])

    @pl.loop(0, n)
    def _(t):
        slot = ring_slot(t, steps)
        plgpu.barrier_wait(consumed.at[slot])

        @pl.when(t + steps < n)
        def _():
            load(t + steps, slot)
        add_dq(t)
    plgpu.wait_smem_to_gmem(0)  # the last reduce-adds done before the CTA exits


def fused_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config,
              interpret):
    """Padded q/o/do [B, Sp, Hq, D], k/v [B, Tp, Hkv, D], lse2 [B, Hq, Sp] (log2 units) ->
    (dq, dk, dv) in the input dtype."""
    if q.shape[-1] > ASYNC_MAX_HEAD_DIM:  # (its launch refuses those above MAX_HEAD_DIM)
        return fused_sync.fused_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, scale=scale,
                                    causal=causal, kv_len=kv_len, config=config,
                                    interpret=interpret)
    # The interpreter's stand-in for the reduce-adds: a slice per (CTA, consumer) tile.
    return common.launch(_kernel, q, k, v, o, lse2, do, q_seg, kv_seg, scale=scale,
                         causal=causal, kv_len=kv_len, config=config, interpret=interpret,
                         dq_slices_per_cta=WGS)


def _kernel(q_shape, k_shape, dtype, *, has_seg, scale, causal, kv_len, config, interpret):
    D, G, bq, bkv, n_q, steps = common.kernel_dims(q_shape, k_shape, config)
    qk_scale = scale * LOG2E
    f32 = lambda shape: plgpu.ACC(shape, jnp.float32)

    # `duplicates` pairs this body's first lines with kernel_sm90_bwd_fused_sync.py's: both forms
    # take the same operands, SMEM and CTA coordinates, unpacked by name; what they share
    # beyond names is in kernel_sm90_bwd_fused_common.py.
    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, dq_acc,
             dk_ref, dv_ref, smem, bars):
        (k_smem2, v_smem2, kseg_smem2, q_smem, do_smem, lse_smem, delta_smem, qseg_smem,
         ds_smem2, p_smem2, dq_smem2) = smem
        own_bars, ring_bars, consumed, dq_full, dq_empty = bars
        c = common.cta_coords(kseg_smem2, has_seg=has_seg, causal=causal, bq=bq, bkv=bkv,
                              n_q=n_q)
        batch, kv_head, wg, cta = c.batch, c.kv_head, c.wg, c.cta
        q_start, per_head = c.q_start, c.per_head

        @pl.when(wg < WGS)
        def _consumer():
            # Only our own tiles: dQ takes our dS and our K.
            kv_base, rows, k_seg, full, full_lo = common.consumer_start(
                (k_ref, v_ref, kseg_ref), (k_smem2, v_smem2, kseg_smem2), own_bars, c,
                has_seg=has_seg, causal=causal, bq=bq, bkv=bkv, n_q=n_q, kv_len=kv_len,
                wait_other_k=False)
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            col = plgpu.Layout.WGMMA.reduce(0)  # vectors along the query (column) axis
            q_bar, do_bar, lse_bar, delta_bar = ring_bars[:4]
            qseg_bar = ring_bars[4] if has_seg else None

            def step(i, carry, base, g, masked=False):
                del g  # the producer names dQ's head (dq_dst)
                dk, dv = carry
                t = base + i
                slot = ring_slot(t, steps)
                z = unhoisted_zero(t)  # K and V's descriptors rebuilt here (registers)
                k_tile, v_tile = k_smem2.at[wg + z], v_smem2.at[wg + z]
                # dS^T's and dQ's tiles too: addresses rebuilt per step, not held across it
                ds_smem, dq_smem = ds_smem2.at[wg + z], dq_smem2.at[wg + z]
                q_tile, do_tile = q_smem.at[slot], do_smem.at[slot]
                for bar in (q_bar, do_bar, lse_bar, delta_bar):
                    plgpu.barrier_wait(bar.at[slot])

                def chain(dv_ref, dk_ref):
                    """The step's five MMAs onto dV and dK, in place (run_state: no second
                    copy of either), and this consumer's dQ tile into SMEM. S^T and dP^T's
                    accumulators are made here and dQ's after them, each zeroed where its
                    scope opens (one scope for all five kept them live through the step)."""
                    def scores(st_ref, dpt_ref):
                        # groups 1 and 2: S^T and dP^T, issued back to back
                        plgpu.wgmma(st_ref, k_tile, q_tile.transpose((1, 0)))
                        plgpu.wgmma(dpt_ref, v_tile, do_tile.transpose((1, 0)))
                        if has_seg:
                            plgpu.barrier_wait(qseg_bar.at[slot])
                        st = plgpu.wgmma_accumulator_load(st_ref, wait_n=1)  # dP^T runs on
                        st = mask_scores_t(
                            st, masked, q_tile=i, bq=bq, kv_base=kv_base,
                            q_seg=qseg_smem.at[slot] if has_seg else None, k_seg=k_seg,
                            col=col, causal=causal, kv_len=kv_len)
                        lse = plgpu.load(lse_smem.at[slot], layout=col)
                        # P^T = exp2(S^T scale log2(e) - lse2): the scale in exp2's FMA
                        pt = jnp.exp2(st * qk_scale - lax.broadcast_in_dim(lse, st.shape, [1]))
                        a_p = a_operand(pt.astype(dtype), p_smem2.at[wg] if interpret else None,
                                        interpret)
                        # group 3: dV += P^T dO, in flight while dS is computed
                        plgpu.wgmma(dv_ref, a_p, do_tile)
                        dpt = plgpu.wgmma_accumulator_load(dpt_ref, wait_n=1)  # dV runs on
                        dlt = plgpu.load(delta_smem.at[slot], layout=col)
                        ds_smem[...] = (pt * (dpt - lax.broadcast_in_dim(dlt, st.shape, [1]))
                                        ).astype(dtype)
                        plgpu.commit_smem()
                    pl.run_scoped(scores, f32((bkv, bq)), f32((bkv, bq)))
                    # The producer's reduce-add of our last dQ tile read it (a step ago, so
                    # this rarely waits); waited for before the chain rather than after its
                    # wait, where ptxas spilled dQ around the mbarrier's retry loop.
                    plgpu.barrier_wait(dq_empty.at[wg])

                    def grads(dq_ref):
                        # groups 4 and 5: dK += dS^T Q and this consumer's share of dQ,
                        # dS K_w, both from dS^T in SMEM; one wait for dV, dK and dQ
                        plgpu.wgmma(dk_ref, ds_smem, q_tile)
                        plgpu.wgmma(dq_ref, ds_smem.transpose((1, 0)), k_tile)
                        dq = plgpu.wgmma_accumulator_load(dq_ref)  # waits for all three
                        plgpu.barrier_arrive(consumed.at[slot])  # Q and dO read: slot free
                        dq_smem[...] = dq  # for the producer, which adds it into dQ by TMA
                    pl.run_scoped(grads, f32((bq, D)))
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(dq_full.at[wg])

                if interpret:  # no run_state there: zero accumulators, added after
                    def scoped(dv_ref, dk_ref):
                        chain(dv_ref, dk_ref)
                        return dv_ref[...], dk_ref[...]
                    ddv, ddk = pl.run_scoped(scoped, f32((bkv, D)), f32((bkv, D)))
                    return dk + ddk, dv + ddv
                dv, dk = pl.run_state(lambda refs: chain(*refs))(
                    (plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                return dk, dv

            dk, dv = common.heads_loop(
                step, (wgmma_zeros((bkv, D)), wgmma_zeros((bkv, D))), G=G, wg=wg,
                q_start=q_start, per_head=per_head, full=full, full_lo=full_lo)
            # The producer's last dq_empty (it read our last dQ tile): every phase observed.
            # No meeting with the other consumer: its chains never read our K or V tiles.
            plgpu.barrier_wait(dq_empty.at[wg])
            store_dkv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, scale=scale, dtype=dtype)

        @pl.when(wg == WGS)
        def _producer_wg():
            refs = (q_ref, do_ref, lse_ref, delta_ref) + ((qseg_ref,) if has_seg else ())
            smems = (q_smem, do_smem, lse_smem, delta_smem, qseg_smem)
            # With documents, the first consumer's copy holds the CTA's range too.
            qs, ph = (lambda: q_start(0)), (lambda: per_head(0))
            load = q_tile_loader(refs, smems, ring_bars, batch=batch, kv_head=kv_head, G=G,
                                 bq=bq, q_start=qs, per_head=ph)

            def dq_dst(t, w):  # step t's dQ tile (q_tile_loader's head and query tile)
                head, i = kv_head * G + lax.div(t, ph()), qs() + lax.rem(t, ph())
                if interpret:  # this (CTA, consumer)'s own slice; XLA sums them
                    return dq_acc.at[cta * WGS + w, batch, pl.ds(i * bq, bq), head]
                return dq_acc.at[batch, pl.ds(i * bq, bq), head]

            def add_dq(t):
                # Each consumer's dQ tile as it arrives, freed once TMA has read it (before
                # the next consumer's is waited for: one consumer's release never waits for
                # the other's tile)
                for w in range(WGS):
                    plgpu.barrier_wait(dq_full.at[w])
                    plgpu.copy_smem_to_gmem(dq_smem2.at[w], dq_dst(t, w),
                                            **({} if interpret else dict(reduction_op="add")))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.barrier_arrive(dq_empty.at[w])

            dq_producer(load, consumed, dq_empty, add_dq, total=lambda: G * ph(),
                        steps=steps, regs=REGS_PRODUCER,
                        range_ready=own_bars.at[2 * WGS] if has_seg else None)

    return common.kernel_entry(
        body, dtype, has_seg=has_seg, bq=bq, bkv=bkv, D=D, steps=steps, interpret=interpret,
        ds_smem=plgpu.SMEM((WGS, bkv, bq), dtype, transforms=common.swizzled(64)),  # dS^T
        # each consumer's dQ tile as TMA reads it: 128-byte swizzle rows of 32 floats
        # (bank-conflict free stores from the WGMMA layout)
        dq_smem=plgpu.SMEM((WGS, bq, D), jnp.float32,
                           transforms=(plgpu.TilingTransform((8, 32)),
                                       plgpu.SwizzleTransform(128))),
        dq_bars=(plgpu.Barrier(num_barriers=WGS),  # dq_full: consumer w's dQ tile written
                 plgpu.Barrier(num_barriers=WGS)))  # dq_empty: the producer read it
