"""Flash attention for Hopper (sm_90a) in Pallas Mosaic GPU: TMA, wgmma, warp specialization.

Forward (FlashAttention-3 structure, after jax's ops/gpu/attention_mgpu.py): a CTA owns
2 x block_q query rows of one (batch, q head); two consumer warpgroups take block_q rows each
and a producer warpgroup streams K and V tiles of the kv head (q head // group) through a
max_concurrent_steps-deep ring of 128B-swizzled SMEM buffers with TMA, signalled by mbarriers.
The consumers run S = Q K^T and O += P V on wgmma with the online softmax in registers, and a
schedule barrier ping-pongs them so one warpgroup's softmax overlaps the other's matmuls.
Additions over the upstream kernel: softmax scale, packed-document masking (segment ids ride
the same TMA ring as K), masking of padded keys (any length), masked finite (no -inf NaNs for
fully masked tiles), bf16 as well as fp16, and the log-sum-exp (log2 units) for the backward.
Causal: tiles left of the diagonal take an unmasked fast path, tiles right of it are skipped.
With segment ids each warpgroup computes only the key tiles tile_ranges.py gives its 64 rows
(read from GMEM as scalars): masked up to its first document's start tile, unmasked while the
tiles lie wholly inside its one document, masked to its last visible tile. The producer streams
the union of the two ranges; a warpgroup drains the tiles outside its own, as the causal tail,
so that ring slots and the schedule barrier stay in step. A row tile that sees nothing writes
a zero output and a log-sum-exp of MASK (finite).

FlashConfig.fwd_overlap (off by default until a GPU measures it) adds FlashAttention-3's
intra-warpgroup pipelining (FA3 Algorithm 2) to the ping-pong: step j issues S_j = Q K_j^T and
O += P_{j-1} V_{j-1} as two wgmma groups, waits for S_j alone (wait_group 1) and runs tile j's
softmax while P_{j-1} V_{j-1} is still on the tensor core; tile lo's scores open the pipeline
and the last P V closes it. Its softmax takes the max on the raw scores and folds the scale
into exp2's FMA (p = exp2(s * scale_log2 - m), m in log2 units: the same log-sum-exp). Both
loops index the Q tile through mosaic_common.unhoisted_zero, so its wgmma descriptors (32
registers at head_dim 256) are rebuilt per step instead of held across the loop: that is what
spilled at head_dim 256 with segment ids (python -m launch.ptxas_report --sm90-fwd-overlap).

Backward: kernel_sm90_bwd.py (Mosaic dq and dkv kernels on the log-sum-exp saved here).

The Mosaic GPU interpreter (CPU tests) lacks run_state and register-A wgmma, so under
interpret=True P goes through SMEM and the PV accumulator is added after the wgmma; the
compiled kernel keeps both in registers. Same arithmetic, checked in the tests only in the
interpreted form; the compiled form is checked by the deviceless H100 compile.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..target import out_struct, sm_count
from ..wgmma import wgmma_into as _wgmma_into

# `duplicates` pairs this list with kernel_sm90_bwd.py's: both kernels read cta_ranges'
# columns (END ... LO) and the mask and log2 constants, names only.
from .mosaic_common import (
    END,
    FIRST,
    FULL_HI,
    FULL_LO,
    HI,
    LO,
    LOG2E,
    MASK,
    cta_ranges,
    interpret_ctx,
    q_block,
    skip_slot,
    tile_mask,
    unhoisted_zero,
)
from .tile_ranges import tile_ranges

COMPUTE_WGS = 2
# setmaxnreg budgets: 2 x 240 + 24 spends the 168-per-thread launch pool of 384 threads; the
# TMA producer fits 24; the softmax warpgroups need up to 232 (docs/attention.md).
REGS_COMPUTE, REGS_PRODUCER = 240, 24
# The forward masks raw scores (the scale is applied inside exp2's FMA): a power of two, so
# that MASK_RAW * qk_scale is exact and s * qk_scale - m, fused or not, is exactly 0 for a row
# whose keys are all masked so far (MASK's rounding error, ~1e22, would overflow exp2).
MASK_RAW = -(2.0 ** 100)
# fwd_persistent with fwd_overlap: up to this head_dim. At 256 the overlapped loop is at the
# compute warpgroups' register budget (216 of 240) and the persistent tile loop's index tips
# causal attention into spilling 4 B (python -m launch.ptxas_report): there the grid form
# runs; fwd_persistent alone runs persistent at every head_dim (0 spills).
PERSISTENT_OVERLAP_MAX_HEAD_DIM = 128
# fwd_persistent prefetches the next tile's Q into a second buffer per consumer up to this
# head_dim: +32 KiB of SMEM at 128 (199,680 B in all); at 256 a second pair of 32 KiB tiles
# exceeds 227 KiB, and the tile's Q is loaded when it starts.
PREFETCH_MAX_HEAD_DIM = 128


def pad_multiples(cfg):
    """Sequence multiples the kernels need: the forward takes 2 x block_q rows per CTA, the
    backward's dq kernel 2 x block_q_bwd rows and its dkv kernel 2 x block_kv_bwd keys."""
    return (COMPUTE_WGS * max(cfg.block_q, cfg.block_q_bwd),
            max(cfg.block_kv, COMPUTE_WGS * cfg.block_kv_bwd))


def _overlapped(o, s_shape, issue, then, interpret: bool):
    """Two wgmma groups in flight (FlashAttention-3 intra-warpgroup overlap): issue(s_ref,
    o_ref) issues S into a fresh accumulator, then a product onto O (o's value); S alone is
    waited for (wait_group 1: groups retire in order) and then(S) runs while O's group is still
    on the tensor core. Returns (O once its group retired, then's result). The interpreter has
    no accumulator store: there O's product goes to a zero accumulator and is added (as
    wgmma_into does), the same arithmetic up to float32 rounding order."""
    def scoped(s_ref, o_ref):
        if not interpret:
            o_ref[...] = o
        issue(s_ref, o_ref)
        out = then(plgpu.wgmma_accumulator_load(s_ref, wait_n=1))
        o_new = o_ref[...]  # waits for every group
        return (o + o_new if interpret else o_new), out
    return pl.run_scoped(scoped, plgpu.ACC(s_shape, jnp.float32),
                         plgpu.ACC(o.shape, jnp.float32))


def flash_fwd(q, k, v, q_seg, kv_seg, *, scale, causal, kv_len, config, interpret):
    """Padded q [B, Sp, Hq, D], k/v [B, Tp, Hkv, D] -> (out, lse2 [B, Hq, Sp] in log2 units)."""
    B, Sp, Hq, D = q.shape
    Tp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    dtype = q.dtype
    block_q, block_kv = config.block_q, config.block_kv
    n_kv = Tp // block_kv
    steps = min(config.max_concurrent_steps, n_kv)
    has_seg = q_seg is not None
    # Tiles below this index need no mask (all keys valid, no segments, left of the diagonal).
    kv_full = 0 if has_seg else kv_len // block_kv
    qk_scale = scale * LOG2E
    overlap = config.fwd_overlap
    # fwd_overlap masks tile lo unless no tile needs a mask at all (not causal, no segment
    # ids, no padded keys): one masked tile instead of a fourth copy of the step.
    first_masked = has_seg or causal or kv_full < n_kv

    def kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, ranges_ref, out_ref, lse_ref, scoped):
        wg = lax.axis_index("wg")
        (qo_smem2, k_smem, v_smem, lse_smem2, qseg_smem2, kseg_smem, p_smem2), bars = scoped
        (k_bars, v_bars, q_bars, kseg_bars, qseg_bars), consumed, sched = bars
        k_consumed, v_consumed = consumed

        def sched_barrier():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        def streamed(batch, q_blk):
            """The key tiles [first, end) the producer streams for both warpgroups of the
            CTA's query block q_blk, and slot_of(t): tile t sits in ring slot
            (t - first) % steps."""
            if has_seg:  # the union of the warpgroups' visited tiles (tile_ranges.py)
                row0 = q_blk * COMPUTE_WGS
                first = ranges_ref[batch, row0, FIRST]
                end = ranges_ref[batch, row0, END]
            elif causal:
                cta_q_end = (q_blk + 1) * (COMPUTE_WGS * block_q)
                first = 0
                end = jnp.minimum(pl.cdiv(cta_q_end, jnp.array(block_kv, jnp.int32)), n_kv)
            else:
                first, end = 0, n_kv

            def slot_of(t):
                if isinstance(t, int):  # a static tile (no segment ids: first = 0)
                    return t % steps
                return lax.rem(t - first if has_seg else t, jnp.array(steps, t.dtype))
            return first, end, slot_of

        def load_q(batch, q_head, q_blk, qs):
            """This warpgroup's Q rows of (batch, q_head, q_blk) (and their segment ids) into
            Q buffer qs."""
            q_base = q_blk * (COMPUTE_WGS * block_q) + wg * block_q
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, block_q), q_head],
                                    qo_smem2.at[qs], q_bars.at[qs])
            if has_seg:
                plgpu.copy_gmem_to_smem(qseg_ref.at[batch, pl.ds(q_base, block_q)],
                                        qseg_smem2.at[qs], qseg_bars.at[qs])

        def q_buffer(batch, q_head, q_blk, t):
            """The Q buffer of this tile, its Q load issued. Prefetching (persistent, Q
            double-buffered): the CTA's first tile loads its own Q, and every tile, once the
            previous tile's output stores have read the other buffer, loads the next tile's Q
            there, so it lands under this tile's loop instead of after its epilogue."""
            if not prefetch:
                load_q(batch, q_head, q_blk, wg)
                return wg
            sm = lax.axis_index("sm")
            qs = lax.rem(lax.div(t - sm, ctas), 2) * COMPUTE_WGS + wg  # parity-th buffer
            pl.when(t == sm)(lambda: load_q(batch, q_head, q_blk, qs))
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            @pl.when(t + ctas < n_tiles)
            def _():
                load_q(*tile_coords(t + ctas), lax.rem(qs + COMPUTE_WGS, 2 * COMPUTE_WGS))
            return qs

        def compute_tile(batch, q_head, q_blk, t=None):
            """One warpgroup's block_q query rows of (batch, q_head, q_blk) (t: its index in
            the persistent tile list): Q in, O and the log-sum-exp out, every K/V slot of the
            CTA's stream released."""
            first, end, slot_of = streamed(batch, q_blk)
            qs = q_buffer(batch, q_head, q_blk, t)
            qo_smem, lse_smem = qo_smem2.at[qs], lse_smem2.at[wg]
            q_base = q_blk * (COMPUTE_WGS * block_q) + wg * block_q
            # This warpgroup computes tiles [lo, hi): masked, unmasked [full_lo, full_hi),
            # masked; it drains the CTA's other tiles (loaded for the other warpgroup).
            if has_seg:  # loaded where needed: not live in registers across the loops
                bound = lambda c: ranges_ref[batch, q_blk * COMPUTE_WGS + wg, c]
                lo, hi = bound(LO), bound(HI)
                full_lo, full_hi = (lambda: bound(FULL_LO)), (lambda: bound(FULL_HI))
            elif causal:
                lo = full_lo = 0
                hi = jnp.minimum(pl.cdiv(q_base + block_q, jnp.array(block_kv, jnp.int32)),
                                 n_kv)
                full_hi = jnp.minimum(lax.div(q_base, jnp.array(block_kv, jnp.int32)), kv_full)
            else:
                lo, full_lo, full_hi, hi = 0, 0, kv_full, n_kv

            if has_seg:
                plgpu.barrier_wait(qseg_bars.at[qs])
                q_seg = plgpu.load(qseg_smem2.at[qs], layout=plgpu.Layout.WGMMA.reduce(1))
            plgpu.barrier_wait(q_bars.at[qs])

            m_i = plgpu.layout_cast(jnp.full((block_q,), MASK, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((block_q,), 0, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((block_q, D), 0, jnp.float32), plgpu.Layout.WGMMA)

            def release_k_and_mask(s, kv_step, slot, masked):
                """Tile kv_step's raw scores s (waited for), masked where `masked`; its K slot
                released to the producer. Every step consumes its key ids' barrier phase; the
                ids are read before the release, and after QK^T: not live across the wgmma
                (spills at head_dim 256)."""
                if has_seg:
                    plgpu.barrier_wait(kseg_bars.at[slot])
                if masked and has_seg:
                    k_seg = plgpu.load(kseg_smem.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                plgpu.barrier_arrive(k_consumed.at[slot])
                if masked:
                    mask = tile_mask(q_base, kv_step * block_kv, (block_q, block_kv),
                                     causal=causal, kv_len=kv_len,
                                     q_seg=q_seg if has_seg else None,
                                     k_seg=k_seg if has_seg else None)
                    s = jnp.where(mask, s, MASK_RAW)
                return s

            def kv_loop(kv_step, carry, masked: bool = False):
                acc, m_i, l_i = carry
                slot = slot_of(kv_step)
                q_tile = qo_smem2.at[qs + unhoisted_zero(kv_step)]  # descriptors: registers

                def compute_qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                    sched_barrier()
                    return acc_ref[...]
                qk = pl.run_scoped(compute_qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                qk = release_k_and_mask(qk, kv_step, slot, masked)
                # The scale rides exp2's FMA (s * qk_scale - m, one FFMA and one ex2 a score)
                # and the max is taken on the raw scores, scaled once per row, as fwd_overlap
                # does: no separate FMUL per score. m_i and the log-sum-exp stay in log2 units.
                m_ij = jnp.maximum(m_i, qk.max(axis=1) * qk_scale)
                alpha = jnp.exp2(m_i - m_ij)
                m_i = m_ij
                p = jnp.exp2(qk * qk_scale - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
                acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i *= alpha
                p16 = p.astype(dtype)

                def end_softmax_barriers():
                    plgpu.barrier_arrive(sched)  # softmax done
                    plgpu.barrier_wait(v_bars.at[slot])
                    plgpu.barrier_wait(sched)  # the tensor core is free
                if D <= 128:
                    l_i += p.sum(axis=1)
                    acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
                    end_softmax_barriers()
                else:
                    end_softmax_barriers()
                    l_i += p.sum(axis=1)

                if interpret:  # the interpreter's wgmma reads A from SMEM only
                    p_smem2.at[wg][...] = p16
                    plgpu.commit_smem()

                def compute_pv(acc_ref):
                    # On the GPU P stays in registers as wgmma's A operand (FA3).
                    plgpu.wgmma(acc_ref, p_smem2.at[wg] if interpret else p16, v_smem.at[slot])
                    nxt = kv_step + 1
                    @pl.when(nxt < hi)
                    def _wait():
                        plgpu.barrier_wait(k_bars.at[slot_of(nxt)])
                acc = _wgmma_into(acc, compute_pv, interpret)
                plgpu.barrier_arrive(v_consumed.at[slot])
                return acc, m_i, l_i

            def drain(kv_step, _):
                # Tiles this warpgroup skips (causal, or outside its documents) are still
                # loaded for the other one: release their slots and keep the schedule barrier
                # in step.
                skip_slot(slot_of(kv_step), (k_bars, v_bars) + ((kseg_bars,) if has_seg else ()),
                          (k_consumed, v_consumed))
                sched_barrier()
                sched_barrier()

            if has_seg:
                lax.fori_loop(first, lo, drain, None)

            # ---- fwd_overlap: FlashAttention-3's intra-warpgroup pipelining (Algorithm 2) ----
            # Step j issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} as two wgmma groups, waits
            # for S_j only and runs tile j's softmax while P_{j-1} V_{j-1} is still on the
            # tensor core; O is rescaled once that group retires. Tile lo's scores open the
            # pipeline, the last P V closes it. Per tile the schedule barrier sees the same
            # two arrivals as in kv_loop and drain, so the warpgroups stay in step.
            def scores_to_p(s, kv_step, m_i, l_i, masked):
                """Tile kv_step's online softmax on its raw scores s (waited for). The scale
                rides exp2's FMA (s * qk_scale - m) and the max is taken on the raw scores,
                scaled per row; m_i and the log-sum-exp stay in log2 units. Releases the K
                slot and arrives on the schedule barrier (softmax done)."""
                s = release_k_and_mask(s, kv_step, slot_of(kv_step), masked)
                m_ij = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
                alpha = jnp.exp2(m_i - m_ij)
                p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_ij, s.shape, [0]))
                l_i = l_i * alpha + p.sum(axis=1)
                plgpu.barrier_arrive(sched)  # softmax done
                return p, m_ij, l_i, alpha

            def p_operand(p16):
                if interpret:  # the interpreter's wgmma reads A from SMEM only
                    p_smem2.at[wg][...] = p16
                    plgpu.commit_smem()
                    return p_smem2.at[wg]
                return p16  # on the GPU P stays in registers as wgmma's A operand

            def first_tile(carry):
                acc, m_i, l_i, _ = carry
                slot = slot_of(lo)
                plgpu.barrier_wait(k_bars.at[slot])

                def qk(s_ref):
                    plgpu.wgmma(s_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    sched_barrier()
                    return scores_to_p(s_ref[...], lo, m_i, l_i, first_masked)
                p, m_i, l_i, _ = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_wait(sched)  # the tensor core is free
                return acc, m_i, l_i, p.astype(dtype)  # acc is still zero: nothing to rescale

            def next_tile(kv_step, carry, masked=False):
                acc, m_i, l_i, p16 = carry
                slot, prev = slot_of(kv_step), slot_of(kv_step - 1)
                plgpu.barrier_wait(k_bars.at[slot])
                plgpu.barrier_wait(v_bars.at[prev])
                p_prev = p_operand(p16)
                q_tile = qo_smem2.at[qs + unhoisted_zero(kv_step)]  # descriptors: registers

                def issue(s_ref, o_ref):
                    plgpu.wgmma(s_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
                    plgpu.wgmma(o_ref, p_prev, v_smem.at[prev])
                    sched_barrier()
                acc, (p, m_i, l_i, alpha) = _overlapped(
                    acc, (block_q, block_kv), issue,
                    lambda s: scores_to_p(s, kv_step, m_i, l_i, masked), interpret)
                plgpu.barrier_arrive(v_consumed.at[prev])
                # P_j is cast into wgmma's A registers only now, P_{j-1} V_{j-1} retired: they
                # held P_{j-1} while it was in flight (cast earlier, ptxas serialized every
                # wgmma, C7513). The barrier keeps LLVM from hoisting the cast above the wait.
                acc, p = lax.optimization_barrier((acc, p))
                p16 = p.astype(dtype)
                acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                plgpu.barrier_wait(sched)  # the tensor core is free
                return acc, m_i, l_i, p16

            def last_pv(carry):
                acc, m_i, l_i, p16 = carry
                prev = slot_of(hi - 1)
                plgpu.barrier_wait(v_bars.at[prev])
                p_last = p_operand(p16)
                acc = _wgmma_into(acc, lambda o_ref: plgpu.wgmma(o_ref, p_last, v_smem.at[prev]),
                                  interpret)
                plgpu.barrier_arrive(v_consumed.at[prev])
                return acc, m_i, l_i, p16

            def overlapped_tiles(acc, m_i, l_i):
                masked_step = functools.partial(next_tile, masked=True)
                p0 = plgpu.layout_cast(jnp.zeros((block_q, block_kv), dtype), plgpu.Layout.WGMMA)
                carry = (acc, m_i, l_i, p0)
                if has_seg:  # a warpgroup may see no tile (lo == hi): no pipeline to open
                    keep, nxt = (lambda c: c), lo + 1
                    carry = lax.cond(lo < hi, first_tile, keep, carry)
                    carry = lax.fori_loop(nxt, full_lo(), masked_step, carry)
                    carry = lax.fori_loop(jnp.maximum(full_lo(), nxt), full_hi(), next_tile,
                                          carry)
                    carry = lax.fori_loop(jnp.maximum(full_hi(), nxt), hi, masked_step, carry)
                    carry = lax.cond(lo < hi, last_pv, keep, carry)
                else:  # lo = full_lo = 0 < hi
                    carry = first_tile(carry)
                    carry = lax.fori_loop(1, full_hi, next_tile, carry)
                    carry = lax.fori_loop(jnp.maximum(full_hi, 1), hi, masked_step, carry)
                    carry = last_pv(carry)
                return carry[:3]

            if overlap:
                pl.when(wg == 1)(sched_barrier)
                acc, m_i, l_i = overlapped_tiles(acc, m_i, l_i)
            else:
                @pl.when(lo < hi)
                def _():
                    plgpu.barrier_wait(k_bars.at[slot_of(lo) if has_seg else 0])

                pl.when(wg == 1)(sched_barrier)

                carry = (acc, m_i, l_i)
                if has_seg:
                    carry = lax.fori_loop(lo, full_lo(), functools.partial(kv_loop, masked=True),
                                          carry)
                    carry = lax.fori_loop(full_lo(), full_hi(), kv_loop, carry)
                    carry = lax.fori_loop(full_hi(), hi, functools.partial(kv_loop, masked=True),
                                          carry)
                else:
                    carry = lax.fori_loop(full_lo, full_hi, kv_loop, carry)
                    carry = lax.fori_loop(full_hi, hi, functools.partial(kv_loop, masked=True),
                                          carry)
                acc, m_i, l_i = carry
            if causal or has_seg:
                lax.fori_loop(hi, end, drain, None)
            pl.when(wg == 0)(sched_barrier)

            if has_seg:  # no key to see (lo == hi): a zero output and lse MASK, finite
                l_i = jnp.where(l_i == 0.0, 1.0, l_i)
            acc /= lax.broadcast_in_dim(l_i, (block_q, D), [0])
            qo_smem[...] = acc.astype(dtype)
            lse_smem[...] = m_i + jnp.log2(l_i)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(q_base, block_q), q_head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, q_head, pl.ds(q_base, block_q)])
            if not prefetch:  # (prefetching, the next tile waits before reusing them)
                plgpu.wait_smem_to_gmem(0)  # qo_smem and lse_smem are free for the next tile

        def producer_tile(batch, q_head, q_blk, t=None):
            """The K/V (and key id) tiles of (batch, q_head, q_blk) through the ring; returns
            once the consumers released every slot, so the next tile starts on a free ring."""
            first, end, _ = streamed(batch, q_blk)
            kv_head = lax.div(q_head, jnp.array(G, q_head.dtype))
            n_load = end - first

            def load(step, slot):
                rows = pl.ds((step + first) * block_kv, block_kv)
                plgpu.copy_gmem_to_smem(k_ref.at[batch, rows, kv_head], k_smem.at[slot],
                                        k_bars.at[slot])
                if has_seg:
                    plgpu.copy_gmem_to_smem(kseg_ref.at[batch, rows], kseg_smem.at[slot],
                                            kseg_bars.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[batch, rows, kv_head], v_smem.at[slot],
                                        v_bars.at[slot])
            for i in range(steps):
                @pl.when(i < n_load)
                def _():
                    load(i, i)

            @pl.loop(0, jnp.maximum(n_load - steps, 0))
            def _(kv_step):
                slot = lax.rem(kv_step, jnp.array(steps, kv_step.dtype))
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])
                load(kv_step + steps, slot)

            # Wait for the consumers to release the last tiles: no barrier phase is left
            # unobserved when the CTA exits.
            @pl.loop(jnp.maximum(n_load - steps, 0), n_load)
            def _(kv_step):
                slot = lax.rem(kv_step, jnp.array(steps, kv_step.dtype))
                plgpu.barrier_wait(k_consumed.at[slot])
                plgpu.barrier_wait(v_consumed.at[slot])

        @pl.when(wg < COMPUTE_WGS)
        def _compute_wg():
            plgpu.set_max_registers(REGS_COMPUTE, action="increase")
            for_each_tile(compute_tile)
            if prefetch:
                plgpu.wait_smem_to_gmem(0)  # the last tile's output

        @pl.when(wg == COMPUTE_WGS)
        def _producer_wg():
            plgpu.set_max_registers(REGS_PRODUCER, action="decrease")
            for_each_tile(producer_tile)

    n_qblk = Sp // (COMPUTE_WGS * block_q)
    n_tiles = n_qblk * Hq * B
    ctas = min(n_tiles, config.persistent_ctas or sm_count() or 132)
    persistent = config.fwd_persistent and not (overlap and D > PERSISTENT_OVERLAP_MAX_HEAD_DIM)
    # Persistent: each consumer double-buffers its Q tile (also the output's staging) and
    # prefetches the next tile's, where SMEM allows.
    prefetch = persistent and D <= PREFETCH_MAX_HEAD_DIM

    def tile_coords(t):
        """(batch, q_head, q_blk) of tile t of the persistent list: ordered by query block,
        longest first when causal, then head, then batch."""
        blk, rest = lax.div(t, Hq * B), lax.rem(t, Hq * B)
        return lax.rem(rest, B), lax.div(rest, B), n_qblk - 1 - blk if causal else blk

    def for_each_tile(tile):
        """tile(batch, q_head, q_blk, t) for this CTA's output tiles, t its index in the
        persistent list (None in the grid form). One per CTA (the grid is heads x query
        blocks x batch), or persistent (fwd_persistent: `ctas` CTAs, CTA c taking tiles c,
        c + ctas, ... of tile_coords' list)."""
        if not persistent:
            return tile(lax.axis_index("batch"), lax.axis_index("heads"),
                        q_block("q_seq", n_qblk, causal))
        # Only t is live across the tiles (the bound and step are constants).
        @pl.loop(lax.axis_index("sm"), n_tiles, step=ctas)
        def _(t):
            tile(*tile_coords(t), t)

    def entry(q_ref, k_ref, v_ref, *rest):
        if has_seg:
            qseg_ref, kseg_ref, ranges_ref, out_ref, lse_ref = rest
        else:
            (out_ref, lse_ref), qseg_ref, kseg_ref, ranges_ref = rest, None, None, None
        tx = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        nbuf_q = 2 if prefetch else 1
        smem = (
            plgpu.SMEM((nbuf_q * COMPUTE_WGS, block_q, D), dtype, transforms=tx),
            plgpu.SMEM((steps, block_kv, D), dtype, transforms=tx),
            plgpu.SMEM((steps, block_kv, D), dtype, transforms=tx),
            plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),
            plgpu.SMEM((nbuf_q * COMPUTE_WGS, block_q), jnp.int32) if has_seg else None,
            plgpu.SMEM((steps, block_kv), jnp.int32) if has_seg else None,
            plgpu.SMEM((COMPUTE_WGS, block_q, block_kv), dtype, transforms=tx) if interpret
            else None,
        )
        barriers = (
            (plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps),
             plgpu.Barrier(num_barriers=nbuf_q * COMPUTE_WGS),
             plgpu.Barrier(num_barriers=steps),
             plgpu.Barrier(num_barriers=nbuf_q * COMPUTE_WGS)),
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),) * 2,
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),
        )
        pl.run_scoped(
            lambda *s: kernel(q_ref, k_ref, v_ref, qseg_ref, kseg_ref, ranges_ref, out_ref,
                              lse_ref, (s[0], (s[1], s[2], s[3]))),
            smem, *barriers, collective_axes="wg")

    out_type = (out_struct(q, q.shape, dtype), out_struct(q, (B, Hq, Sp), jnp.float32))
    args = (q, k, v)
    if has_seg:  # [B, Sp / block_q, 6]: each warpgroup's key tiles and its CTA's
        args += (q_seg, kv_seg, cta_ranges(tile_ranges(q_seg, kv_seg, rows=block_q,
                                                       cols=block_kv, causal=causal,
                                                       kv_len=kv_len), COMPUTE_WGS))
    grid = dict(grid=(ctas,), grid_names=("sm",)) if persistent else dict(
        grid=(Hq, n_qblk, B), grid_names=("heads", "q_seq", "batch"))
    with interpret_ctx(interpret):
        out, lse = plgpu.kernel(
            entry, out_type=out_type, **grid,
            num_threads=COMPUTE_WGS + 1, thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
        )(*args)
    return out, lse

