"""Flash attention backward for Hopper (sm_90a) in Pallas Mosaic GPU: TMA, wgmma, warp
specialization, causal tile skipping, GQA summed in the kernel, packed-document masking.

FlashAttention-2's split into two kernels that each recompute P = exp2(S - lse2) from the
forward's log-sum-exp (log2 units), with delta = rowsum(dO * O) computed once in XLA:

  dq:  a CTA owns wgs x block_q query rows of one (batch, q head); each consumer warpgroup
       keeps its Q and dO tiles in SMEM and a dQ accumulator in registers while the producer
       warpgroup streams the kv head's K and V tiles through a TMA ring:
         S = Q K^T, P = exp2(S - lse2), dP = dO V^T, dS = P (dP - delta), dQ += dS K.
       Causal: a warpgroup stops at its diagonal tile and drains the tiles the other one
       still needs.
  dkv: a CTA owns wgs x block_kv keys of one (batch, kv head); each consumer keeps K and V in
       SMEM and dK, dV accumulators in registers while the producer streams Q, dO, lse2,
       delta (and segment ids) tiles of all G q heads of the kv head:
         S^T = K Q^T and dP^T = V dO^T (issued together), P^T = exp2(S^T - lse2),
         dV += P^T dO, dS^T = P^T (dP^T - delta), dK += dS^T Q.
       GQA needs no [B, T, Hq, D] temporaries: the G heads' contributions are summed in the
       accumulators. Causal: query tiles wholly before a warpgroup's keys are never loaded
       for the CTA, and the one the second warpgroup does not see is drained.

The split recomputes S and dP once more (3.5 instead of 2.5 forward-matmul units).
FlashConfig.bwd_fused runs FA3's one kernel instead (kernel_sm90_bwd_fused.py: dQ by TMA
reduce-adds; in the interpreter, which has no TMA reduction, by per-CTA slices summed in XLA)
at head dims up to FUSED_MAX_HEAD_DIM, where it is the shipped default (config.py): these two
kernels run there with bwd_fused=False (the loan's A/B alternative); at 256, the grid kernels.

Tiles left of the causal diagonal and inside the valid keys take an unmasked fast path. With
segment ids both kernels visit only the tiles of tile_ranges.py (dq: key tiles per query tile;
dkv: query tiles per key tile, transposed), unmasked wholly inside one document; the producer
streams the union of the warpgroups' ranges (for each of the G heads in dkv) and each
warpgroup drains the tiles outside its own. dq reads its bounds from GMEM (cta_ranges); dkv
gets them behind each key tile's ids in the same TMA copy and walks [lo, hi) in one loop with
the mask switched per tile (lax.cond): a further GMEM operand, bounds held in registers, or
three loops make it spill at head_dim 128 (ptxas). A head_dim of 256 uses one consumer
warpgroup so the SMEM ring stays under 227 KiB.
Interpreter differences (as in kernel_sm90.py): P and dS go through SMEM as wgmma's A operand
and accumulators are added after the wgmma; the compiled kernel keeps both in registers.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..target import out_struct
from ..wgmma import wgmma_into as _wgmma_into
from .kernel_sm90_bwd_fused import fused_bwd
from .mosaic_common import (
    END,
    FIRST,
    FULL_HI,
    FULL_LO,
    HI,
    LO,
    LOG2E,
    MASK,
    a_operand,
    cta_ranges,
    dkv_scores,
    grid_bwd,
    interpret_ctx,
    kv_major_bars,
    kv_major_smem,
    load_kv_tile,
    load_own,
    load_own_tiles,
    masked_plain_masked,
    q_block,
    q_producer_wg,
    ring_producer,
    ring_slot,
    skip_slot,
    softmax_delta,
    store_dkv,
    tile_mask,
    unhoisted_zero,
    wgmma_zeros,
    wgmmas,
)
from .tile_ranges import tile_ranges

TX = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# setmaxnreg budgets. The CTA launches at 168 registers per thread (65536 over 384 threads);
# 2 x 240 + 24 spends exactly that pool. The producer's TMA issue fits 24 without spilling;
# the dkv consumer needs 240 on its masked (diagonal) tiles at head_dim 128 (ptxas: 16 B of
# spills at 232).
REGS_COMPUTE, REGS_PRODUCER = 240, 24


def bwd_wgs(head_dim: int) -> int:
    """Consumer warpgroups per CTA: two, or one at head_dim 256 (SMEM)."""
    return 2 if head_dim <= 128 else 1



def _dims(q, k, config):
    """A backward call's (B, Sp, Hq, D), (Tp, Hkv), G, dtype, consumer warpgroups, (bq, bkv)."""
    Hq, Hkv = q.shape[2], k.shape[2]
    return (q.shape, k.shape[1:3], Hq // Hkv, q.dtype, bwd_wgs(q.shape[3]),
            (config.block_q_bwd, config.block_kv_bwd))


def _launch(entry, out_type, grid, seq_name, wgs, args, interpret):
    """Both kernels: grid (heads, sequence blocks, batch), wgs consumers + 1 producer; the
    segment-id operands only when given."""
    args = args[:6] + (args[6:] if args[6] is not None else ())  # segment ids and ranges
    with interpret_ctx(interpret):
        return plgpu.kernel(
            entry, out_type=out_type, grid=grid, grid_names=("heads", seq_name, "batch"),
            num_threads=wgs + 1, thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
        )(*args)


def _dq(q, k, v, do, lse2, delta, q_seg, kv_seg, *, scale, causal, kv_len, config, interpret):
    (B, Sp, Hq, D), (Tp, Hkv), G, dtype, wgs, (bq, bkv) = _dims(q, k, config)
    n_kv = Tp // bkv
    steps = min(config.max_concurrent_steps, n_kv)
    has_seg = q_seg is not None
    kv_full = 0 if has_seg else kv_len // bkv  # tiles below this need no kv_len/segment mask
    qk_scale = scale * LOG2E

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, ranges_ref,
               dq_ref, smem, bars):
        batch, q_head, wg = (lax.axis_index(a) for a in ("batch", "heads", "wg"))
        q_smem2, do_smem2, lse_smem2, delta_smem2, qseg_smem2, k_smem, v_smem, kseg_smem, \
            ds_smem2 = smem
        own_bars, k_bars, v_bars, kseg_bars, consumed = bars
        row0 = q_block("q_seq", Sp // (wgs * bq), causal) * wgs  # the CTA's first row tile
        cta_q = row0 * bq
        # Key tiles [first, end) stream through the ring, tile t in slot (t - first) % steps.
        if has_seg:  # the union of the warpgroups' visited tiles (tile_ranges.py)
            first, end = ranges_ref[batch, row0, FIRST], ranges_ref[batch, row0, END]
        elif causal:
            first = 0
            end = jnp.minimum(pl.cdiv(cta_q + wgs * bq, jnp.array(bkv, jnp.int32)), n_kv)
        else:
            first, end = 0, n_kv

        def slot_of(t):
            return ring_slot(t - first if has_seg else t, steps)

        @pl.when(wg < wgs)
        def _consumer():
            plgpu.set_max_registers(REGS_COMPUTE, action="increase")
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            q_base = cta_q + wg * bq
            rows = (batch, pl.ds(q_base, bq), q_head)
            vec = (batch, q_head, pl.ds(q_base, bq))
            own = [(q_ref.at[rows], q_smem), (do_ref.at[rows], do_smem),
                   (lse_ref.at[vec], lse_smem2.at[wg]), (delta_ref.at[vec], delta_smem2.at[wg])]
            if has_seg:
                own.append((qseg_ref.at[batch, pl.ds(q_base, bq)], qseg_smem2.at[wg]))
            load_own(own, own_bars, wg, wgs)
            row = plgpu.Layout.WGMMA.reduce(1)
            lse = plgpu.load(lse_smem2.at[wg], layout=row)
            dlt = plgpu.load(delta_smem2.at[wg], layout=row)
            q_seg = plgpu.load(qseg_smem2.at[wg], layout=row) if has_seg else None
            # This warpgroup computes key tiles [lo, hi): masked, unmasked [full_lo, full_hi),
            # masked; it drains the CTA's other tiles (loaded for the other warpgroup).
            if has_seg:  # each bound loaded where a loop needs it: none stays live
                bound = functools.partial(lambda c, row: ranges_ref[batch, row, c],
                                          row=row0 + wg)
            elif causal:
                bound = {LO: 0, FULL_LO: 0, FULL_HI: jnp.minimum(
                    lax.div(q_base, jnp.array(bkv, jnp.int32)), kv_full),
                    HI: jnp.minimum(pl.cdiv(q_base + bq, jnp.array(bkv, jnp.int32)), n_kv),
                    END: end}.__getitem__
            else:
                bound = {LO: 0, FULL_LO: 0, FULL_HI: kv_full, HI: n_kv}.__getitem__

            def step(t, dq, masked=False):
                slot = slot_of(t)
                plgpu.barrier_wait(k_bars.at[slot])
                plgpu.barrier_wait(v_bars.at[slot])
                s, dp = wgmmas(((q_smem, k_smem.at[slot].transpose((1, 0))),
                                (do_smem, v_smem.at[slot].transpose((1, 0)))), (bq, bkv))
                s = s * qk_scale
                if masked:
                    k_seg = None
                    if has_seg:
                        plgpu.barrier_wait(kseg_bars.at[slot])
                        k_seg = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                    mask = tile_mask(q_base, t * bkv, (bq, bkv), causal=causal, kv_len=kv_len,
                                      q_seg=q_seg, k_seg=k_seg)
                    s = jnp.where(mask, s, MASK)
                elif has_seg:  # keep the segment barrier's phases in step
                    plgpu.barrier_wait(kseg_bars.at[slot])
                p = jnp.exp2(s - lax.broadcast_in_dim(lse, s.shape, [0]))
                ds = p * (dp - lax.broadcast_in_dim(dlt, s.shape, [0]))
                a = a_operand(ds.astype(dtype), ds_smem2.at[wg] if interpret else None,
                              interpret)
                dq = _wgmma_into(dq, lambda acc: plgpu.wgmma(acc, a, k_smem.at[slot]),
                                 interpret)
                plgpu.barrier_arrive(consumed.at[slot])
                return dq

            def drain(t, _):
                # Tiles past this warpgroup's diagonal or outside its documents, loaded for
                # the other one.
                skip_slot(slot_of(t), (k_bars, v_bars) + ((kseg_bars,) if has_seg else ()),
                          (consumed,))

            dq = wgmma_zeros((bq, D))
            if has_seg:
                lax.fori_loop(first, bound(LO), drain, None)
                dq = masked_plain_masked(*(functools.partial(bound, c)
                                           for c in (LO, FULL_LO, FULL_HI, HI)),
                                         lambda t, dq, masked: step(t, dq, masked), dq)
            else:
                dq = lax.fori_loop(bound(FULL_LO), bound(FULL_HI), step, dq)
                dq = lax.fori_loop(bound(FULL_HI), bound(HI),
                                   functools.partial(step, masked=True), dq)
            if causal or has_seg:
                lax.fori_loop(bound(HI), bound(END), drain, None)
            q_smem[...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[rows])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _producer_wg():
            kv_head = lax.div(q_head, jnp.array(G, q_head.dtype))

            def load(t, slot):
                load_kv_tile((k_ref, v_ref) + ((kseg_ref,) if has_seg else ()),
                             (k_smem, v_smem, kseg_smem), (k_bars, v_bars, kseg_bars), slot,
                             batch=batch, rows=pl.ds((t + first) * bkv, bkv), kv_head=kv_head)
            ring_producer(end - first, steps, load, consumed, REGS_PRODUCER)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if has_seg:
            qseg_ref, kseg_ref, ranges_ref, dq_ref = rest
        else:
            (dq_ref,), qseg_ref, kseg_ref, ranges_ref = rest, None, None, None
        smem = (
            plgpu.SMEM((wgs, bq, D), dtype, transforms=TX),
            plgpu.SMEM((wgs, bq, D), dtype, transforms=TX),
            plgpu.SMEM((wgs, bq), jnp.float32),
            plgpu.SMEM((wgs, bq), jnp.float32),
            plgpu.SMEM((wgs, bq), jnp.int32) if has_seg else None,
            plgpu.SMEM((steps, bkv, D), dtype, transforms=TX),
            plgpu.SMEM((steps, bkv, D), dtype, transforms=TX),
            plgpu.SMEM((steps, bkv), jnp.int32) if has_seg else None,
            plgpu.SMEM((wgs, bq, bkv), dtype, transforms=TX) if interpret else None,
        )
        n_own = 5 if has_seg else 4
        bars = (plgpu.Barrier(num_barriers=n_own * wgs), plgpu.Barrier(num_barriers=steps),
                plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps),
                plgpu.Barrier(num_arrivals=wgs, num_barriers=steps))
        pl.run_scoped(
            lambda s, b: kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref,
                                kseg_ref, ranges_ref, dq_ref, s, b),
            smem, bars, collective_axes="wg")

    ranges = None if not has_seg else cta_ranges(tile_ranges(
        q_seg, kv_seg, rows=bq, cols=bkv, causal=causal, kv_len=kv_len), wgs)
    return _launch(entry, out_struct(q, q.shape, dtype), (Hq, Sp // (wgs * bq), B), "q_seq",
                   wgs, (q, k, v, do, lse2, delta, q_seg, kv_seg, ranges), interpret)


def _dkv(q, k, v, do, lse2, delta, q_seg, kv_seg, *, scale, causal, kv_len, config, interpret):
    (B, Sp, Hq, D), (Tp, Hkv), G, dtype, wgs, (bq, bkv) = _dims(q, k, config)
    n_q = Sp // bq
    steps = min(config.max_concurrent_steps, G * n_q)
    has_seg = q_seg is not None
    qk_scale = scale * LOG2E
    i32 = lambda x: jnp.array(x, jnp.int32)

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, dk_ref,
               dv_ref, smem, bars):
        batch, kv_head, wg = (lax.axis_index(a) for a in ("batch", "heads", "wg"))
        k_smem2, v_smem2, kseg_smem2, q_smem, do_smem, lse_smem, delta_smem, qseg_smem, \
            p_smem2, ds_smem2 = smem
        own_bars, ring_bars, consumed = bars
        row0 = lax.axis_index("kv_seq") * wgs  # the CTA's first key tile
        cta_kv = row0 * bkv
        # Query tiles [q_start, q_end) stream through the ring for each of the G q heads.
        if has_seg:  # the union of the warpgroups' visited tiles (tile_ranges.py, transposed),
            # read from SMEM where used: they arrive behind each key tile's ids (kseg_smem2),
            # in every row. A consumer reads its own row (the copy it waited for), the
            # producer the first consumer's.
            q_start = lambda row: kseg_smem2[row, bkv + FIRST]
            per_head = lambda row: kseg_smem2[row, bkv + END] - kseg_smem2[row, bkv + FIRST]
        else:
            # Causal: query tile i sees keys >= base only if its last query (i+1)*bq - 1 >= base.
            start = jnp.minimum(lax.div(cta_kv, i32(bq)), n_q) if causal else i32(0)
            q_start = lambda row: start
            per_head = lambda row: n_q - start  # query tiles the CTA streams for each q head
        ring_smem = (q_smem, do_smem, lse_smem, delta_smem, qseg_smem)

        @pl.when(wg < wgs)
        def _consumer():
            plgpu.set_max_registers(REGS_COMPUTE, action="increase")
            k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
            # With documents the key tile's ids and, after them, its cta_ranges row: one TMA
            # copy (another GMEM operand or a bound held in registers makes the kernel spill).
            kv_base, rows = load_own_tiles(
                k_ref, v_ref, kseg_ref, k_smem2, v_smem2, kseg_smem2, own_bars, batch=batch,
                kv_head=kv_head, wg=wg, row0=row0, cta_kv=cta_kv, bkv=bkv, wgs=wgs,
                has_seg=has_seg, wait_other_k=False)
            col = plgpu.Layout.WGMMA.reduce(0)  # vectors along the query (column) axis
            k_seg = (plgpu.load(kseg_smem2.at[wg, pl.ds(0, bkv)],
                                layout=plgpu.Layout.WGMMA.reduce(1)) if has_seg else None)
            # This warpgroup computes query tiles [lo, hi), with no mask on [full_lo, full_hi);
            # it drains the CTA's other tiles.
            if has_seg:
                bound = lambda c: kseg_smem2[wg, bkv + c]
            else:
                if causal:
                    lo = jnp.minimum(lax.div(kv_base, i32(bq)), n_q)
                    # Tiles from here on lie wholly on or below the diagonal: no causal mask.
                    diag_end = jnp.minimum(pl.cdiv(kv_base + bkv - 1, i32(bq)), n_q)
                else:
                    lo, diag_end = q_start(wg), i32(0)
                # Padded keys in this block (masked so they stay finite) mask all.
                mask_all = kv_base + bkv > kv_len
                full_lo = jnp.where(mask_all, n_q, jnp.maximum(diag_end, lo))
                bound = {LO: lo, FULL_LO: full_lo, FULL_HI: n_q}.__getitem__

            def step(i, carry, base, masked=False):
                dk, dv = carry
                slot = ring_slot(base + i, steps)
                # K and V stay put for the whole loop: indexed through unhoisted_zero, their
                # wgmma descriptors are rebuilt here rather than held in registers across it
                # (mosaic_common.unhoisted_zero), which leaves room for S^T and dP^T to be
                # issued together and waited for once (0 spills at head_dim 128; 8-16 B with
                # the descriptors hoisted, so they used to run one after the other).
                z = unhoisted_zero(base + i)
                tiles = (k_smem2.at[wg + z], v_smem2.at[wg + z],
                         p_smem2.at[wg] if interpret else None)
                dv, dst = dkv_scores(dv, masked, slot, tiles, ring_smem, ring_bars, q_tile=i,
                                     bq=bq, bkv=bkv, kv_base=kv_base, k_seg=k_seg,
                                     qk_scale=qk_scale, col=col, dtype=dtype, causal=causal,
                                     kv_len=kv_len, interpret=interpret)
                a_ds = a_operand(dst.astype(dtype), ds_smem2.at[wg] if interpret else None,
                                 interpret)
                dk = _wgmma_into(dk, lambda acc: plgpu.wgmma(acc, a_ds, q_smem.at[slot]),
                                 interpret)
                plgpu.barrier_arrive(consumed.at[slot])
                return dk, dv

            def drain(i, _, base):
                # Query tiles before this warpgroup's keys (or outside its documents), loaded
                # for the other one.
                skip_slot(ring_slot(base + i, steps), ring_bars, (consumed,))

            def head(g, carry):
                # Query tile i of head g is the CTA's ring step base + i.
                base = g * per_head(wg) - q_start(wg)
                lax.fori_loop(q_start(wg), bound(LO), functools.partial(drain, base=base), None)
                if has_seg:
                    # One loop over [lo, hi) with the mask decided per tile: three loops (masked,
                    # unmasked, masked) hold three copies of the step and spill (ptxas).
                    def seg_step(i, carry):
                        whole = (bound(FULL_LO) <= i) & (i < bound(FULL_HI))
                        return step(i, carry, base, masked=jnp.logical_not(whole))
                    carry = lax.fori_loop(bound(LO), bound(HI), seg_step, carry)
                    lax.fori_loop(bound(HI), bound(END), functools.partial(drain, base=base),
                                  None)
                    return carry
                carry = lax.fori_loop(bound(LO), bound(FULL_LO),
                                      functools.partial(step, base=base, masked=True), carry)
                return lax.fori_loop(bound(FULL_LO), bound(FULL_HI),
                                     functools.partial(step, base=base), carry)

            dk, dv = lax.fori_loop(0, G, head, (wgmma_zeros((bkv, D)), wgmma_zeros((bkv, D))))
            store_dkv(dk, dv, k_smem, v_smem, dk_ref, dv_ref, rows, scale=scale, dtype=dtype)

        q_producer_wg(wg, wgs, (q_ref, do_ref, lse_ref, delta_ref, qseg_ref), ring_smem, ring_bars,
                      consumed, own_bars, batch=batch, kv_head=kv_head, G=G, bq=bq,
                      q_start=q_start, per_head=per_head, steps=steps, regs=REGS_PRODUCER)

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if has_seg:
            qseg_ref, kseg_ref, dk_ref, dv_ref = rest
        else:
            (dk_ref, dv_ref), qseg_ref, kseg_ref = rest, None, None
        smem = kv_major_smem(wgs, bkv=bkv, bq=bq, D=D, steps=steps, dtype=dtype, tx=TX,
                             has_seg=has_seg) + (
            plgpu.SMEM((wgs, bkv, bq), dtype, transforms=TX) if interpret else None,  # P^T
            plgpu.SMEM((wgs, bkv, bq), dtype, transforms=TX) if interpret else None,  # dS^T
        )
        bars = kv_major_bars(wgs, steps, has_seg)
        pl.run_scoped(
            lambda s, b: kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref,
                                kseg_ref, dk_ref, dv_ref, s, b),
            smem, bars, collective_axes="wg")

    if has_seg:  # [B, Tp / bkv, bkv + RANGE_COLS]: each key tile's ids, then the query tiles
        # it sees (tile_ranges.py, transposed) with its CTA's union (cta_ranges)
        ranges = cta_ranges(tile_ranges(q_seg, kv_seg, rows=bkv, cols=bq, causal=causal,
                                        kv_len=kv_len, transposed=True), wgs)
        kv_seg = jnp.concatenate([kv_seg.reshape(B, Tp // bkv, bkv), ranges], axis=-1)
    return _launch(entry, (out_struct(k, k.shape, dtype), out_struct(v, v.shape, dtype)),
                   (Hkv, Tp // (wgs * bkv), B), "kv_seq", wgs,
                   (q, k, v, do, lse2, delta, q_seg, kv_seg), interpret)


# Head dims FlashConfig.bwd_fused runs at: 64 and 128, with 0 spills (ptxas at 240 registers:
# dK, dV and dQ's accumulators, 160 floats per thread, beside the score tiles; see
# kernel_sm90_bwd_fused.py on the descriptors it keeps out of the registers).
FUSED_MAX_HEAD_DIM = 128

# Head dims whose Mosaic wgmma backward fits the registers: at 256 a warpgroup's dQ, or its dK
# and dV, accumulators are 128 or 256 float32 per thread, and ptxas spills 0.5-3 KB
# (docs/attention.md, machine code).
MAX_BWD_HEAD_DIM = 128


def flash_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config, interpret):
    """Backward of kernel_sm90.flash_fwd: the Mosaic (wgmma) dq and dkv kernels here, or with
    FlashConfig.bwd_fused the single kernel of kernel_sm90_bwd_fused.py, on the log-sum-exp in
    log2 units that the forward saves; above MAX_BWD_HEAD_DIM the grid kernels
    (mosaic_common.grid_bwd)."""
    kw = dict(scale=scale, causal=causal, kv_len=kv_len, config=config, interpret=interpret)
    if q.shape[-1] > MAX_BWD_HEAD_DIM:
        return grid_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, **kw)
    if config.bwd_fused and q.shape[-1] <= FUSED_MAX_HEAD_DIM:
        # FlashAttention-3's one kernel (kernel_sm90_bwd_fused.py)
        return fused_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, **kw)
    return mosaic_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, **kw)


def mosaic_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config,
               interpret):
    """Padded q/o/do [B, Sp, Hq, D], k/v [B, Tp, Hkv, D], lse2 [B, Hq, Sp] (log2 units, as
    kernel_sm90.flash_fwd saves it) -> (dq, dk, dv) in the input dtype."""
    # delta_i = sum_d dO_id O_id: one fused XLA reduction, read by both kernels.
    delta = softmax_delta(o, do)
    kw = dict(scale=scale, causal=causal, kv_len=kv_len, config=config, interpret=interpret)
    dq = _dq(q, k, v, do, lse2, delta, q_seg, kv_seg, **kw)
    dk, dv = _dkv(q, k, v, do, lse2, delta, q_seg, kv_seg, **kw)
    return dq, dk, dv
