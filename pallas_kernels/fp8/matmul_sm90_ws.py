"""Hopper (sm_90) FP8 matmul, warp-specialized and persistent (Sm90Config.structure="ws_2wg").

Three warpgroups per CTA: a producer (the last one, 40 registers) streams A [tile_m, tile_k] and
B^T [tile_n, tile_k] tiles by TMA into a `max_concurrent_steps`-deep SMEM ring guarded by
mbarriers (plgpu.emit_pipeline_warp_specialized); two consumers each own 64 rows of the
tile_m = 128 output tile and issue wgmma on their half of the A stage against the shared B^T
stage (CUTLASS's "cooperative" split), with the registers the producer gave up (232 per
thread). The CTAs are persistent: the grid is one CTA per SM (Sm90Config.num_ctas) and each
walks output tiles lin, lin + num_ctas, ... in a grouped raster (plgpu.planar_snake: bands of
`raster_width` tile rows, snaking along N), so consecutive waves reuse A and B^T tiles from L2.
The producer runs ahead across tile boundaries (it refills a stage as soon as both consumers
release it), and each consumer's TMA store of one tile drains while the next tile multiplies.
With Sm90Config.epilogue_n the store goes out in column slices through two SMEM slots per
consumer, freeing SMEM for TMA stages (128 x 256: 3 stages instead of 2).

Promotion (promote_every >= 1) as in matmul_sm90: each K tile's wgmma runs into a fresh
accumulator that is then added into the float32 total. A consumer waits only for its own
wgmma, so while one warpgroup adds its partial (FADDs on the CUDA cores) the other's wgmma
keeps the tensor cores of the same SM sub-partitions busy: the promotion cost overlaps instead
of stalling the SM as it does with one warpgroup. Scales: tensorwise (one float32 product)
or rowwise (a per-row scale of A [M] and per-column scale of B [N]), applied to the float32
total in the epilogue.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8.config import Sm90Config
from pallas_kernels.target import sm_count
from pallas_kernels.wgmma import wgmma_into

CONSUMERS = 2  # consumer warpgroups; the producer is warpgroup CONSUMERS (emit_pipeline's rule)
PRODUCER_REGISTERS = 40  # TMA issue needs few; the rest go to the consumers' accumulators


def _swizzled(rows_cols_bytes: int, itemsize: int):
    swizzle = plgpu.find_swizzle(rows_cols_bytes * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _consumer_body(config: Sm90Config, rows, interpret: bool):
    """The per-K-tile body of one consumer warpgroup, (carry -> carry), and its initial carry.
    `rows`: this warpgroup's 64 rows of the A stage."""
    wm, tn, every = config.tile_m // CONSUMERS, config.tile_n, config.promote_every
    zeros = lambda: plgpu.layout_cast(jnp.zeros((wm, tn), jnp.float32), plgpu.Layout.WGMMA)

    def issue(acc_ref, a_smem, bt_smem):
        plgpu.wgmma(acc_ref, a_smem.at[rows], bt_smem.T)

    if every == 0:  # one accumulator over K: the wgmma stays in flight (delay_release=1)
        def body(_, a_smem, bt_smem, acc_ref):
            issue(acc_ref, a_smem, bt_smem)
            plgpu.wgmma_wait(1)  # the previous step's wgmma is done: its stage is released
            return acc_ref
        return body, None
    if every == 1:
        def body(_, a_smem, bt_smem, total):
            def tile(acc_ref):
                issue(acc_ref, a_smem, bt_smem)
                return acc_ref[...]  # waits for this warpgroup's wgmma only
            return total + pl.run_scoped(tile, plgpu.ACC((wm, tn), jnp.float32))
        return body, zeros

    def body(idx, a_smem, bt_smem, carry):  # a partial over `every` K tiles, then the total
        total, part = carry
        part = wgmma_into(part, lambda r: issue(r, a_smem, bt_smem), interpret)
        return jax.lax.cond((idx[0] + 1) % every == 0,
                            lambda t, p: (t + p, zeros()), lambda t, p: (t, p), total, part)
    return body, lambda: (zeros(), zeros())


def _kernel(a_gmem, bt_gmem, sa_gmem, sb_gmem, out_gmem, *, config: Sm90Config, tiles: tuple,
            rowwise: bool, interpret: bool):
    tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
    wm, (m_iters, n_iters, k_iters) = tm // CONSUMERS, tiles
    out_dtype = out_gmem.dtype
    item = jnp.dtype(out_dtype).itemsize
    op_transforms = _swizzled(tk, 1)
    delay = 0 if config.promote_every else 1  # see _consumer_body

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=PRODUCER_REGISTERS,
            in_specs=[plgpu.BlockSpec((tm, tk), lambda k: (0, k), transforms=op_transforms,
                                      delay_release=delay),
                      plgpu.BlockSpec((tn, tk), lambda k: (0, k), transforms=op_transforms,
                                      delay_release=delay)],
            wg_axis="wg", num_compute_wgs=CONSUMERS,
            max_concurrent_steps=config.max_concurrent_steps, compute_context=context)

    ignore = lambda *_, **__: None  # the allocations do not depend on the bodies

    # Allocated once for the whole persistent loop, so that the producer can fill stages of the
    # next output tile while the consumers finish this one (no scope exit between tiles).
    en = config.epilogue_n or tn  # columns per epilogue store
    slots = 1 if config.epilogue_n is None else 2  # sliced: double-buffered per consumer

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(a_gmem, bt_gmem),
        o_smem=plgpu.SMEM((CONSUMERS, slots, wm, en), out_dtype,
                          transforms=_swizzled(en * item, item)),
        collective_axes="wg")
    def _scope(allocs, o_smem):
        wg = jax.lax.axis_index("wg")
        rows = pl.ds(wg * wm, wm)

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tile(info):
            mi, ni = plgpu.planar_snake(info.index[0], (m_iters, n_iters), 1,
                                        config.raster_width)
            body, init = _consumer_body(config, rows, interpret)
            out_rows, out_cols = pl.ds(mi * tm + wg * wm, wm), pl.ds(ni * tn, tn)

            def context(run):
                if init is None:
                    acc = pl.run_scoped(lambda r: run(r)[...],
                                        plgpu.ACC((wm, tn), jnp.float32))
                else:
                    acc = run(init())
                    acc = acc if config.promote_every == 1 else acc[0] + acc[1]
                acc = scaled(acc, sa_gmem, sb_gmem, out_rows, out_cols, rowwise)
                for j in range(tn // en):
                    # TMA stores read o_smem asynchronously: the one that last read this slot
                    # must be done (slice j - 2, or any of the previous tile's at j = 0)
                    plgpu.wait_smem_to_gmem(0 if j == 0 else slots - 1, wait_read_only=True)
                    buf = o_smem.at[wg, j % slots]
                    buf[...] = acc[:, j * en:(j + 1) * en].astype(out_dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        buf, out_gmem.at[out_rows, pl.ds(ni * tn + j * en, en)])

            pipeline(body, context)(a_gmem.at[pl.ds(mi * tm, tm)],
                                    bt_gmem.at[pl.ds(ni * tn, tn)], allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores land before exit


def scaled(acc, sa_gmem, sb_gmem, out_rows, out_cols, rowwise: bool):
    """acc times its scales: one scalar (tensorwise; both scales pre-multiplied), or A's row
    scales along rows and B's column scales along columns (rowwise), loaded in the slices of
    the WGMMA layout the accumulator's registers hold."""
    if not rowwise:
        return acc * sa_gmem[0]
    wgmma = plgpu.Layout.WGMMA
    sa = plgpu.load(sa_gmem.at[out_rows], layout=wgmma.reduce(1), optimized=False)
    acc = acc * jax.lax.broadcast_in_dim(sa, acc.shape, [0])
    sb = plgpu.load(sb_gmem.at[out_cols], layout=wgmma.reduce(0), optimized=False)
    return acc * jax.lax.broadcast_in_dim(sb, acc.shape, [1])


def tiles_and_ctas(m: int, n: int, k: int, config: Sm90Config) -> tuple[tuple, int]:
    """(M, N, K tile counts) and the persistent grid: min(output tiles, config.num_ctas, by
    default the target's SM count)."""
    tiles = (m // config.tile_m, n // config.tile_n, k // config.tile_k)
    ctas = config.num_ctas or sm_count() or 132
    return tiles, max(1, min(tiles[0] * tiles[1], ctas))


def kernel_scales(a_scale, b_scale, m: int, n: int, config: Sm90Config):
    """(sa, sb, rowwise): the float32 vectors both sm90 kernels read in their epilogue.
    Scalars (tensorwise) become sa = [a_scale * b_scale], sb = [1]; a_scale [M] and b_scale
    [N] (rowwise: per row of A, per column of B) stay as they are."""
    a_scale, b_scale = jnp.asarray(a_scale, jnp.float32), jnp.asarray(b_scale, jnp.float32)
    if a_scale.ndim == 0 and b_scale.ndim == 0:
        return (a_scale * b_scale).reshape(1), jnp.ones((1,), jnp.float32), False
    if a_scale.shape != (m,) or b_scale.shape != (n,):
        raise ValueError(f"sm90 scales are scalars (tensorwise) or a_scale [M={m}] and b_scale "
                         f"[N={n}] (rowwise); got {a_scale.shape} and {b_scale.shape}")
    # ptxas (deviceless H100): ws_2wg rowwise at 128 x 192 with promotion spills 16 B; the
    # scale vectors and their addresses do not fit beside the 192 accumulator registers.
    if config.structure == "ws_2wg" and config.promote_every and config.tile_n > 128:
        raise ValueError(f"rowwise scales with promotion need tile_n <= 128 in ws_2wg (got "
                         f"{config.tile_n}: it spills registers)")
    return a_scale, b_scale, True


def fp8_matmul_sm90_ws(a, bt, sa, sb, out_dtype, *, rowwise: bool, config: Sm90Config,
                       interpret=None):
    """The ws_2wg kernel (checked shapes and scales from kernel_scales; see
    matmul_sm90.fp8_matmul_sm90)."""
    (m, _), (n, k) = a.shape, bt.shape
    tiles, ctas = tiles_and_ctas(m, n, k, config)
    kernel = plgpu.kernel(
        functools.partial(_kernel, config=config, tiles=tiles, rowwise=rowwise,
                          interpret=interpret is not None),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(ctas,), grid_names=("sm",),
        num_threads=CONSUMERS + 1, thread_name="wg",
        interpret=interpret,
    )
    return kernel(a, bt, sa, sb)
