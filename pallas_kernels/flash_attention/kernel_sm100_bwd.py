"""Flash attention backward for Blackwell (sm_100a) in Pallas Mosaic GPU: tcgen05 MMAs with
scores and gradient accumulators in tensor memory (TMEM), warp-specialised.

FlashAttention-2's split into a dq and a dkv kernel that recompute P = exp2(S - lse2) from the
forward's log-sum-exp (log2 units); delta = rowsum(dO * O) comes from XLA. Both have the same
shape: a CTA keeps 128 *resident* rows (one per TMEM lane) and streams tiles of the other side:

  dq   resident Q, dO (+ lse2, delta) of one (batch, q head); streams K, V of its kv head.
         X = Q K^T, Y = dO V^T, P = exp2(X - lse2), dS = P (Y - delta), dQ += dS K.
  dkv  resident K, V of one (batch, kv head); streams Q, dO, lse2, delta of all G q heads of
       the kv head (GQA summed in the TMEM accumulators, no [B, T, Hq, D] temporaries).
         X = K Q^T, Y = V dO^T, P^T, dS^T as above, dV += P^T dO, dK += dS^T Q.

Three warpgroups, as in the forward (kernel_sm100.py):
  load     TMA: the resident tiles once, then a max_concurrent_steps-deep ring of streamed
           tiles (with their lse2/delta/segment ids in dkv, segment ids in dq);
  mma      issues X_t and Y_t into TMEM, then the accumulator MMAs of step t-1 from the P/dS
           tiles in SMEM: the tensor core computes the next scores while the softmax
           warpgroup works on the current ones;
  compute  X_t, Y_t TMEM -> registers, mask, P and dS -> SMEM (bf16/fp16), and at the end the
           accumulators TMEM -> HBM.
Causal: streamed tiles wholly past the diagonal are never loaded; tiles wholly inside it (and
inside the valid keys, without segment ids) skip the mask. Segment ids: each CTA streams only
the tiles [lo, hi) of tile_ranges.py (computed in XLA, read from GMEM as scalars; dkv per
q head, the same range for every head of the group) and skips the mask on [full_lo, full_hi),
tiles wholly inside the resident rows' one document. A CTA with no tile to visit (its rows see
no key, or no query sees its keys) writes a zero gradient.

TMEM: X and Y (block of the streamed side each) plus the accumulators (head_dim columns each)
must fit 512 columns, and SMEM 227 KiB: head_dim 64 and 128. At 256 flash_bwd falls back to
the grid kernels of kernel_bwd.py.

FlashConfig.bwd_fused (fused_bwd, off until a GPU measures it): one kernel, the dkv kernel
plus dQ, as FlashAttention-3/4 do it, so X and Y (S and dP) are computed once per tile: 5
matmul units per tile against the split's 7.
  mma      after step t's dV and dK MMAs, also dQ_t = dS_t K (an M = 64 tcgen05 MMA, dS read
           as the transpose of dS^T's SMEM tile, K the resident tile) into one of two TMEM
           buffers, once the dQ warpgroup has drained the buffer's step t - 2;
  dq       a fourth warpgroup: dQ_t TMEM -> registers -> SMEM (fp32) -> TMA reduce-add into a
           float32 [B, S, Hq, D] buffer that XLA scales and casts (FA3's dQ_accum).
TMEM at head_dim 128: dK, dV 256 + two dQ tiles (M = 64: D / 2 columns each) 128 + X, Y in
one buffer 128 = 512 (at 64: X, Y double-buffered, 448). The interpreter has no TMA
reduction: there each key block adds into its own slice of the buffer, which XLA sums.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ..target import out_struct
from .mosaic_common import (
    LOG2E,
    MASK,
    column_slices,
    grid_bwd,
    interpret_ctx,
    masked_plain_masked,
    q_block,
    reduce_added_dq,
    softmax_delta,
)
from .tile_ranges import tile_ranges

BLOCK = 128  # resident rows per CTA: one per TMEM lane
_COMPUTE, _MMA, _LOAD, _DQ = 0, 1, 2, 3
# setmaxnreg per thread: a CTA of 4 warpgroups starts at 128 each (65536 / 512); the fused
# kernel's dQ warpgroup holds one [n, D] fp32 tile (64 floats per thread at most: TMEM refuses
# n = 128 at head_dim 128), and 40 + 40 + 232 + 96 <= 512.
REGS_DQ = 96
MAX_HEAD_DIM = 128
TMEM_COLS = 512
# Streamed-tile columns the compute warpgroup holds in registers at a time: in dkv lse2 and
# delta add two column vectors per slice (16 spill-free by ptxas, 32 spills 36 bytes).
SLICE = {"dq": 32, "dkv": 16}


def _transforms(cols: int, dtype, max_swizzle: int = 128):
    size = jnp.dtype(dtype).itemsize
    swizzle = min(plgpu.find_swizzle(cols * size * 8), max_swizzle)
    return plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle)


def _kernel(kind, q, k, v, do, lse2, delta, q_seg, kv_seg, dq_acc=None, *, scale, causal,
            kv_len, config, interpret):
    B, Sp, Hq, D = q.shape
    Tp, Hkv = k.shape[1], k.shape[2]
    G, dtype = Hq // Hkv, q.dtype
    is_dq = kind == "dq"
    fused = kind == "fused"  # dkv, plus dQ_t = dS_t K per step, reduce-added into dq_acc
    has_seg = q_seg is not None
    n = config.block_kv_bwd if is_dq else config.block_q_bwd  # streamed tile rows
    n_tiles = (Tp if is_dq else Sp) // n
    steps = min(config.max_concurrent_steps, n_tiles if is_dq else G * n_tiles)
    qk_scale = scale * LOG2E
    i32 = jnp.int32
    row, col = plgpu.Layout.TCGEN05.reduce(1), plgpu.Layout.TCGEN05.reduce(0)
    vec_axis = 0 if is_dq else 1  # lse2/delta run along the queries: rows in dq, columns in dkv
    n_acc = 1 if is_dq else 2
    width = min(n, SLICE["dq" if is_dq else "dkv"])
    # fused: dQ_t [n, D] in two TMEM buffers (the MMA of step t+1 writes one while the dQ
    # warpgroup drains the other); at n = 64 an M = 64 accumulator spans D / 2 columns.
    dq_cols = 2 * D * n // BLOCK if fused else 0
    # X and Y double-buffered in TMEM where the 512 columns allow (head_dim <= 128 at n = 64):
    # the MMAs of tile t+1 then run while the compute warpgroup works through tile t. One
    # buffer (config.tmem_buffers_bwd=1) serialises them: the choices section times both.
    fixed_cols = n_acc * D + dq_cols
    nbuf = config.tmem_buffers_bwd or (2 if 4 * n + fixed_cols <= TMEM_COLS else 1)
    if 2 * nbuf * n + fixed_cols > TMEM_COLS:
        raise ValueError(
            f"FlashConfig(tmem_buffers_bwd={nbuf}, block_{'kv' if is_dq else 'q'}_bwd={n}) at "
            f"head_dim {D}: the {kind} kernel's X and Y tiles, {n_acc} accumulator(s)"
            f"{' and two dQ tiles' if fused else ''} need {2 * nbuf * n + fixed_cols} TMEM "
            f"columns, over {TMEM_COLS}; use tmem_buffers_bwd=1 or a smaller block")

    def kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, ranges_ref,
               out_refs, res_smem, str_smem, ds_smem, p_smem, x_tmem, y_tmem, acc_tmem,
               res_loaded, loaded, free, s_ready, s_read, ds_ready, ds_free, dq_refs,
               dq_out):
        wg = lax.axis_index("wg")
        batch, head = lax.axis_index("batch"), lax.axis_index("heads")
        # dq: causal query blocks longest first; dkv: key block 0 already sees the most queries.
        blk = q_block("blk", Sp // BLOCK, causal) if is_dq else lax.axis_index("blk")
        base = blk * BLOCK
        res_rows = pl.ds(base, BLOCK)

        def visits():
            """The streamed tiles this CTA visits (per q head in dkv): [lo, hi), masked except
            [full_lo, full_hi); steps t = 0 .. total-1 count them from lo (every head in dkv):
            (lo, full_lo, full_hi, hi, total). Each warpgroup reads them in its own branch:
            values live across set_max_registers would count against the 40-register ones."""
            if has_seg:
                lo, full_lo, full_hi, hi = (ranges_ref[batch, blk, c] for c in range(4))
            elif is_dq:
                lo = full_lo = i32(0)
                if causal:
                    hi = jnp.minimum(pl.cdiv(base + BLOCK, i32(n)), n_tiles)
                    full_hi = jnp.minimum(lax.div(base, i32(n)), i32(kv_len // n))
                else:
                    hi, full_hi = i32(n_tiles), i32(kv_len // n)
            else:
                lo = jnp.minimum(lax.div(base, i32(n)), n_tiles) if causal else i32(0)
                diag_end = (jnp.minimum(pl.cdiv(base + BLOCK - 1, i32(n)), n_tiles) if causal
                            else i32(0))
                # Padded keys in this block: masked, so that their rows stay finite.
                full_lo = jnp.where(base + BLOCK > kv_len, n_tiles, jnp.maximum(diag_end, lo))
                full_hi = hi = i32(n_tiles)
            return lo, full_lo, full_hi, hi, (hi - lo) * (1 if is_dq else G)

        def streamed(t, lo, hi):
            """HBM views of streamed step t, in str_smem's order."""
            if is_dq:
                rows, kv_head = pl.ds((lo + t) * n, n), lax.div(head, i32(G))
                views = [k_ref.at[batch, rows, kv_head], v_ref.at[batch, rows, kv_head]]
                return views + ([kseg_ref.at[batch, rows]] if has_seg else [])
            per_head = hi - lo
            g, i = lax.div(t, per_head), lo + lax.rem(t, per_head)
            rows, h = pl.ds(i * n, n), head * G + g
            views = [q_ref.at[batch, rows, h], do_ref.at[batch, rows, h],
                     lse_ref.at[batch, h, rows], delta_ref.at[batch, h, rows]]
            return views + ([qseg_ref.at[batch, rows]] if has_seg else [])

        def resident():
            if is_dq:
                views = [q_ref.at[batch, res_rows, head], do_ref.at[batch, res_rows, head],
                         lse_ref.at[batch, head, res_rows], delta_ref.at[batch, head, res_rows]]
                return views + ([qseg_ref.at[batch, res_rows]] if has_seg else [])
            views = [k_ref.at[batch, res_rows, head], v_ref.at[batch, res_rows, head]]
            return views + ([kseg_ref.at[batch, res_rows]] if has_seg else [])

        @pl.when(wg == _LOAD)
        def _load():
            plgpu.set_max_registers(40, action="decrease")
            for src, dst in zip(resident(), res_smem):
                plgpu.copy_gmem_to_smem(src, dst, res_loaded)
            lo, _, _, hi, total = visits()

            @pl.loop(0, total)
            def _(t):
                slot = lax.rem(t, i32(steps))

                @pl.when(t >= steps)
                def _():  # the MMAs of step t - steps are done with this slot
                    plgpu.barrier_wait(free.at[slot])
                for src, dst in zip(streamed(t, lo, hi), str_smem):
                    plgpu.copy_gmem_to_smem(src, dst.at[slot], loaded.at[slot])

            @pl.loop(jnp.maximum(total - steps, 0), total)
            def _(t):  # observe the last frees: no barrier phase is left pending at exit
                plgpu.barrier_wait(free.at[lax.rem(t, i32(steps))])

        @pl.when(wg == _MMA)
        def _mma():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.barrier_wait(res_loaded)
            total = visits()[-1]
            res0, res1 = res_smem[0], res_smem[1]
            str0, str1 = str_smem[0], str_smem[1]

            def accumulate(t):  # dQ += dS K  |  dK += dS^T Q, dV += P^T dO (fused: + dQ_t)
                slot = lax.rem(t, i32(steps))
                plgpu.barrier_wait(ds_ready)
                plgpu.tcgen05_mma(acc_tmem[0], ds_smem, str0.at[slot], accumulate=t > 0)
                if not is_dq:
                    plgpu.tcgen05_mma(acc_tmem[1], p_smem, str1.at[slot], accumulate=t > 0)
                plgpu.tcgen05_commit_arrive(free.at[slot])
                if fused:
                    _mma_dq(t, res0)
                plgpu.tcgen05_commit_arrive(ds_free)

            def _mma_dq(t, k_smem):
                """dQ_t = dS_t K (dS^T's SMEM tile read transposed) into TMEM buffer t % 2,
                once the dQ warpgroup has drained step t - 2's."""
                dq_tmem, dq_ready, dq_read = dq_refs[:3]
                buf = lax.rem(t, i32(2))
                for b in range(2):  # a static TMEM ref per buffer (M = 64 layouts)
                    @pl.when(buf == b)
                    def _():
                        @pl.when(t >= 2)
                        def _():
                            plgpu.barrier_wait(dq_read.at[b])
                        plgpu.tcgen05_mma(dq_tmem[b], ds_smem.transpose((1, 0)), k_smem,
                                          accumulate=False)
                        plgpu.tcgen05_commit_arrive(dq_ready.at[b])

            @pl.loop(0, total)
            def _(t):
                slot, buf = lax.rem(t, i32(steps)), lax.rem(t, i32(nbuf))
                plgpu.barrier_wait(loaded.at[slot])

                @pl.when(t >= nbuf)
                def _():  # the compute warpgroup has read X and Y of step t - nbuf
                    plgpu.barrier_wait(s_read.at[buf])
                cols = pl.ds(buf * n, n)
                plgpu.tcgen05_mma(x_tmem.at[:, cols], res0, str0.at[slot].transpose((1, 0)),
                                  accumulate=False)
                plgpu.tcgen05_mma(y_tmem.at[:, cols], res1, str1.at[slot].transpose((1, 0)),
                                  accumulate=False)
                plgpu.tcgen05_commit_arrive(s_ready.at[buf])

                @pl.when(t >= 1)
                def _():
                    accumulate(t - 1)

            @pl.when(total > 0)
            def _():
                accumulate(total - 1)

            @pl.loop(jnp.maximum(total - nbuf, 0), total)
            def _(t):  # observe the last reads: no barrier phase is left pending at exit
                plgpu.barrier_wait(s_read.at[lax.rem(t, i32(nbuf))])
            if fused:
                @pl.loop(jnp.maximum(total - 2, 0), total)
                def _(t):  # and the dQ warpgroup's last drains
                    plgpu.barrier_wait(dq_refs[2].at[lax.rem(t, i32(2))])

        if fused:
            @pl.when(wg == _DQ)
            def _dq():
                # dQ_t TMEM -> registers -> SMEM (fp32) -> TMA reduce-add into dq_acc (GPU);
                # the interpreter, which has no TMA reduction, gives each CTA its own slice of
                # dq_acc instead, summed by XLA (as kernel_sm90_bwd_fused.py).
                plgpu.set_max_registers(REGS_DQ, action="decrease")
                dq_tmem, dq_ready, dq_read, dq_smem = dq_refs
                lo, _, _, hi, total = visits()
                per_head = hi - lo

                @pl.loop(0, total)
                def _(t):
                    buf = lax.rem(t, i32(2))
                    g, i = lax.div(t, per_head), lo + lax.rem(t, per_head)
                    for b in range(2):
                        @pl.when(buf == b)
                        def _():
                            plgpu.barrier_wait(dq_ready.at[b])
                            # The whole tile in one load: n * D / 128 floats per thread (64 at
                            # most); column slices of an M = 64 TMEM tile defeat Mosaic's
                            # layout inference.
                            dq = plgpu.async_load_tmem(dq_tmem[b])
                            plgpu.wait_load_tmem()
                            plgpu.barrier_arrive(dq_read.at[b])  # free for step t + 2's MMA
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last add read it
                            dq_smem[...] = dq
                    plgpu.commit_smem()
                    rows, h = pl.ds(i * n, n), head * G + g
                    if interpret:
                        plgpu.copy_smem_to_gmem(dq_smem, dq_out.at[blk, batch, rows, h])
                    else:
                        plgpu.copy_smem_to_gmem(dq_smem, dq_out.at[batch, rows, h],
                                                reduction_op="add")
                plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == _COMPUTE)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(res_loaded)
            if is_dq:
                res_lse = plgpu.load(res_smem[2], layout=row)
                res_delta = plgpu.load(res_smem[3], layout=row)
            res_seg = plgpu.load(res_smem[-1], layout=row) if has_seg else None
            lo, full_lo, full_hi, hi, total = visits()
            per_head = hi - lo

            def step(t, tile, masked):
                slot, buf = lax.rem(t, i32(steps)), lax.rem(t, i32(nbuf))
                if not is_dq or has_seg:  # this step's vectors ride the ring
                    plgpu.barrier_wait(loaded.at[slot])
                plgpu.barrier_wait(s_ready.at[buf])
                # `width` columns at a time: in dkv lse2 and delta are per streamed row, n
                # values per thread each (column vectors of the TCGEN05 layout), so whole tiles
                # of X, Y, P, lse2 and delta live at once spill (ptxas, docs/attention.md).
                for c in range(0, n, width):
                    w = min(width, n - c)
                    shape, cols = (BLOCK, w), pl.ds(c, w)
                    x = plgpu.async_load_tmem(x_tmem.at[:, pl.ds(buf * n + c, w)])
                    plgpu.wait_load_tmem()
                    x = x * qk_scale
                    if masked:
                        own = base + plgpu.broadcasted_iota(i32, shape, 0,
                                                            layout=plgpu.Layout.TCGEN05)
                        other = tile * n + c + plgpu.broadcasted_iota(
                            i32, shape, 1, layout=plgpu.Layout.TCGEN05)
                        q_ids, k_ids = (own, other) if is_dq else (other, own)
                        mask = k_ids < kv_len
                        if causal:
                            mask &= k_ids <= q_ids
                        if has_seg:
                            str_seg = plgpu.load(str_smem[-1].at[slot, cols], layout=col)
                            mask &= (lax.broadcast_in_dim(res_seg, shape, [0])
                                     == lax.broadcast_in_dim(str_seg, shape, [1]))
                        x = jnp.where(mask, x, MASK)
                    lse = res_lse if is_dq else plgpu.load(str_smem[2].at[slot, cols], layout=col)
                    p = jnp.exp2(x - lax.broadcast_in_dim(lse, shape, [vec_axis]))
                    y = plgpu.async_load_tmem(y_tmem.at[:, pl.ds(buf * n + c, w)])
                    plgpu.wait_load_tmem()
                    dlt = res_delta if is_dq else plgpu.load(str_smem[3].at[slot, cols],
                                                             layout=col)
                    ds = p * (y - lax.broadcast_in_dim(dlt, shape, [vec_axis]))
                    if c == 0:
                        @pl.when(t >= 1)
                        def _():  # the accumulator MMAs of step t-1 are done with P/dS
                            plgpu.barrier_wait(ds_free)
                    ds_smem.at[:, cols][...] = ds.astype(dtype)
                    if not is_dq:
                        p_smem.at[:, cols][...] = p.astype(dtype)
                plgpu.barrier_arrive(s_read.at[buf])
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready)

            def tiles(g):  # one q head's tiles (dq: the only one), t counted from lo
                at = lambda i: g * per_head + i - lo
                if has_seg and is_dq:  # one copy of each step (dkv: two passes spill)
                    masked_plain_masked(lambda: lo, lambda: full_lo, lambda: full_hi,
                                        lambda: hi, lambda i, c, masked: step(at(i), i, masked),
                                        None)
                    return
                # Without segment ids lo == full_lo in dq, full_hi == hi in dkv: two loops.
                if has_seg or not is_dq:
                    lax.fori_loop(lo, full_lo, lambda i, c: step(at(i), i, True), None)
                lax.fori_loop(full_lo, full_hi, lambda i, c: step(at(i), i, False), None)
                if has_seg or is_dq:
                    lax.fori_loop(full_hi, hi, lambda i, c: step(at(i), i, True), None)

            if is_dq:
                tiles(i32(0))
            else:
                lax.fori_loop(0, G, lambda g, c: tiles(g), None)

            @pl.when(total > 0)
            def _():
                plgpu.barrier_wait(ds_free)  # the last accumulator MMAs

            @pl.when(total == 0)
            def _():  # no visible tiles (keys past every query, or no shared document): zero
                zeros = plgpu.layout_cast(jnp.full((BLOCK, D), 0, jnp.float32),
                                          plgpu.Layout.TCGEN05)
                for a in acc_tmem:
                    plgpu.async_store_tmem(a, zeros)
                plgpu.commit_tmem()
            if is_dq:
                dst_views = [out_refs[0].at[batch, res_rows, head]]
            else:
                dst_views = [out_refs[0].at[batch, res_rows, head],
                             out_refs[1].at[batch, res_rows, head]]
            # One accumulator and one column slice at a time: both [128, D] float32
            # accumulators at once are 2 D registers per thread (spills at head_dim 128).
            for i, (acc, smem) in enumerate(zip(acc_tmem, res_smem)):
                for cols in column_slices(D):
                    a = plgpu.async_load_tmem(acc.at[:, cols])
                    plgpu.wait_load_tmem()
                    if i == 0:
                        a = a * scale  # dQ and dK carry the softmax scale of S
                    smem.at[:, cols][...] = a.astype(dtype)
            plgpu.commit_smem()
            for smem, dst in zip(res_smem, dst_views):
                plgpu.copy_smem_to_gmem(smem, dst, commit_group=False)
            plgpu.commit_smem_to_gmem_group()
            plgpu.wait_smem_to_gmem(0)

    # P/dS tiles swizzled `width` columns wide: the compute warpgroup stores them a slice at a
    # time, and a store must cover whole swizzle tiles.
    tile_tx, p_tx = _transforms(D, dtype), _transforms(width, dtype)
    tiles = lambda *shape: plgpu.SMEM(shape, dtype, transforms=tile_tx)
    seg = has_seg
    if is_dq:
        res = [tiles(BLOCK, D), tiles(BLOCK, D), plgpu.SMEM((BLOCK,), jnp.float32),
               plgpu.SMEM((BLOCK,), jnp.float32)]
        ring = [tiles(steps, n, D), tiles(steps, n, D)]
    else:
        # fused: K is also dQ's B operand, whose N (= D) an M = 64 MMA splits in two halves
        # of whole swizzle rows: rows of D / 2 elements at most.
        size = jnp.dtype(dtype).itemsize
        k_tx = _transforms(D, dtype, D * size // 2 if fused and n < BLOCK else 128)
        res = [plgpu.SMEM((BLOCK, D), dtype, transforms=k_tx), tiles(BLOCK, D)]
        ring = [tiles(steps, n, D), tiles(steps, n, D), plgpu.SMEM((steps, n), jnp.float32),
                plgpu.SMEM((steps, n), jnp.float32)]
    if seg:
        res.append(plgpu.SMEM((BLOCK,), jnp.int32))
        ring.append(plgpu.SMEM((steps, n), jnp.int32))
    tc = dict(orders_tensor_core=True)
    scratch = dict(
        res_smem=res, str_smem=ring,
        ds_smem=plgpu.SMEM((BLOCK, n), dtype, transforms=p_tx),
        p_smem=None if is_dq else plgpu.SMEM((BLOCK, n), dtype, transforms=p_tx),
        x_tmem=plgpu.TMEM((BLOCK, nbuf * n), jnp.float32),
        y_tmem=plgpu.TMEM((BLOCK, nbuf * n), jnp.float32),
        acc_tmem=[plgpu.TMEM((BLOCK, D), jnp.float32) for _ in range(1 if is_dq else 2)],
        res_loaded=plgpu.Barrier(num_arrivals=len(res)),
        loaded=plgpu.Barrier(num_arrivals=len(ring), num_barriers=steps),
        free=plgpu.Barrier(num_barriers=steps, **tc),
        s_ready=plgpu.Barrier(num_barriers=nbuf, **tc),
        s_read=plgpu.Barrier(num_barriers=nbuf, **tc),
        ds_ready=plgpu.Barrier(**tc), ds_free=plgpu.Barrier(**tc),
        dq_refs=(
            [plgpu.TMEM((n, D), jnp.float32) for _ in range(2)],
            plgpu.Barrier(num_barriers=2, **tc), plgpu.Barrier(num_barriers=2, **tc),
            plgpu.SMEM((n, D), jnp.float32, transforms=(
                plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))),
        ) if fused else None,
    )
    scratch = {k_: v_ for k_, v_ in scratch.items() if v_ is not None}
    n_out = 1 if is_dq else 2

    def entry(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, **scratch_refs):
        qseg_ref, kseg_ref, ranges_ref = rest[:3] if has_seg else (None, None, None)
        out_refs = rest[3:] if has_seg else rest
        dq_out, out_refs = (out_refs[0], out_refs[1:]) if fused else (None, out_refs)
        assert len(out_refs) == n_out
        scratch_refs.setdefault("p_smem", None)
        scratch_refs.setdefault("dq_refs", None)
        kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qseg_ref, kseg_ref, ranges_ref,
               out_refs, dq_out=dq_out, **scratch_refs)

    if is_dq:
        out_type = out_struct(q, q.shape, dtype)
        grid = (Hq, Sp // BLOCK, B)
    else:
        out_type = (out_struct(k, k.shape, dtype), out_struct(v, v.shape, dtype))
        grid = (Hkv, Tp // BLOCK, B)
    args = (q, k, v, do, lse2, delta)
    if has_seg:  # [B, 128-row blocks, 4]: the streamed tiles each CTA visits (tile_ranges.py)
        args += (q_seg, kv_seg, tile_ranges(q_seg, kv_seg, rows=BLOCK, cols=n, causal=causal,
                                            kv_len=kv_len, transposed=not is_dq))
    with interpret_ctx(interpret):
        return plgpu.kernel(
            entry, out_type=out_type, scratch_types=scratch,
            grid=grid, grid_names=("heads", "blk", "batch"),
            num_threads=4 if fused else 3, thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
        )(*args, *([dq_acc] if fused else []))


def flash_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config, interpret):
    """Backward of kernel_sm100.flash_fwd: the tcgen05 dq and dkv kernels here on the saved
    log-sum-exp; at head_dim 256 (over TMEM's 512 columns there) the grid kernels
    (mosaic_common.grid_bwd)."""
    kw = dict(scale=scale, causal=causal, kv_len=kv_len, config=config, interpret=interpret)
    if q.shape[-1] > MAX_HEAD_DIM:
        return grid_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, **kw)
    if config.bwd_fused:
        return fused_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, **kw)
    return mosaic_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, **kw)


def fused_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config,
              interpret):
    """FlashConfig.bwd_fused: the dkv kernel that also computes dQ_t = dS_t K per streamed
    tile and adds it into a float32 [B, Sp, Hq, D] buffer (TMA reduce-add), which XLA scales
    and casts: S and dP once per tile (5 matmul units, not the split's 7) -> (dq, dk, dv)."""
    delta = softmax_delta(o, do)
    return reduce_added_dq(  # each key block's CTAs add into it (the interpreter: one slice)
        q, k.shape[1] // BLOCK, scale, interpret,
        lambda dq_acc: _kernel("fused", q, k, v, do, lse2, delta, q_seg, kv_seg, dq_acc,
                               scale=scale, causal=causal, kv_len=kv_len, config=config,
                               interpret=interpret))


def mosaic_bwd(q, k, v, o, lse2, do, q_seg, kv_seg, *, scale, causal, kv_len, config,
               interpret):
    """Padded q/o/do [B, Sp, Hq, D], k/v [B, Tp, Hkv, D] (Sp, Tp multiples of 128), lse2
    [B, Hq, Sp] in log2 units as kernel_sm100.flash_fwd saves it -> (dq, dk, dv)."""
    delta = softmax_delta(o, do)
    kw = dict(scale=scale, causal=causal, kv_len=kv_len, config=config, interpret=interpret)
    dq = _kernel("dq", q, k, v, do, lse2, delta, q_seg, kv_seg, **kw)
    dk, dv = _kernel("dkv", q, k, v, do, lse2, delta, q_seg, kv_seg, **kw)
    return dq, dk, dv
