"""Blackwell (sm_100) MXFP8 matmul: Pallas Mosaic GPU, block-scaled tcgen05 MMA with the
accumulator and the e8m0 scales in tensor memory (TMEM).

One CTA per (tile_m, tile_n) output tile, one warpgroup, warp-specialised: warp 0 streams the
A [M, K] and B^T [N, K] tiles and their scale tiles by TMA into `max_concurrent_steps` SMEM
stages; warp 1 copies each stage's scales SMEM -> TMEM and issues one block-scaled tcgen05 MMA
(kind::mxf8f6f4, scale_vec::1X: one e8m0 scale per 32 elements of K, applied by the tensor
core itself, so no epilogue rescaling); the MMA's completion frees the stage for the next
load. Then the whole warpgroup drains the float32 accumulator TMEM -> registers -> SMEM -> HBM
in `epilogue_n`-column slices, casting to the output dtype.

Scales reach the tensor core in the "1X scale-factor layout" of the PTX ISA: per 128 rows and
4 scale columns (128 elements of K), a [32, 16] byte tile in which row r holds the scales of
rows r, r+32, r+64, r+96 for the 4 K-blocks (`to_tcgen05_scale_layout`). The wrapper does that
rearrangement once per call on the [MN, K/32] scales quantize_mxfp8 returns; it is a
permutation (tested against its inverse on CPU), and inside a jit XLA fuses it into the
producer.

B operands come K-major (B^T) as for the Hopper kernel: the caller quantizes W^T directly.
The Mosaic GPU interpreter of jax 0.11.2 implements neither the block-scaled tcgen05 MMA (its
tcgen05_mma asserts no scales) nor the SMEM -> TMEM scale copy, so under the interpreter
(`interpret=`) the MMA step alone is replaced by `_stand_in_mma`: it decodes the scale tiles the
kernel's TMA staged in SMEM by the PTX 1X layout, dequantises the staged A/B tiles with them and
issues a plain tcgen05 MMA into the same TMEM accumulator; the loads, barriers and epilogue
stay the kernel's own (test_sm100.py checks the values against reference.py). Without
`interpret` the kernel is traced exactly as before: the block-scaled instruction itself only
runs on a B200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8.config import E8M0, MX_BLOCK, Sm100Config, check_kmajor_operands

_TMA_WARP, _MMA_WARP = 0, 1


def supported(m: int, n: int, k: int, config: Sm100Config = Sm100Config()) -> bool:
    """Whole tiles only (no masking in this kernel); dispatch falls back otherwise."""
    return m % config.tile_m == 0 and n % config.tile_n == 0 and k % config.tile_k == 0


def to_tcgen05_scale_layout(scales_MNkb: jax.Array) -> jax.Array:
    """[MN, K/32] e8m0 scales -> [MN/128, K/128, 32, 16], the layout tcgen05 reads (MN a
    multiple of 128, K a multiple of 128)."""
    mn, kb = scales_MNkb.shape
    if mn % 128 or kb % 4:
        raise ValueError(f"scales {scales_MNkb.shape}: rows must be a multiple of 128 and "
                         "scale columns of 4 (K a multiple of 128)")
    return (scales_MNkb.reshape(mn // 128, 4, 32, kb // 4, 4)
            .transpose(0, 3, 2, 1, 4)
            .reshape(mn // 128, kb // 4, 32, 16))


def from_tcgen05_scale_layout(tiles: jax.Array) -> jax.Array:
    """Inverse of to_tcgen05_scale_layout."""
    mt, kt = tiles.shape[:2]
    return (tiles.reshape(mt, kt, 32, 4, 4)
            .transpose(0, 3, 2, 1, 4)
            .reshape(mt * 128, kt * 4))


def decode_tcgen05_scale_tile(tile: jax.Array) -> jax.Array:
    """One stage's scale tile [MN/128, tk/128, 32, 16] (as staged in SMEM) -> [MN, tk/32]:
    the scale the block-scaled MMA applies to row r and K-block j, read where the PTX ISA's
    1X scale-factor layout puts it (byte (r % 128) // 32 * 4 + j % 4 of row r % 32 of the
    [32, 16] tile of 128-row chunk r // 128 and 4-block group j // 4). Written from the ISA's
    formula, not as the inverse of to_tcgen05_scale_layout, so the two check each other."""
    mt, kt = tile.shape[:2]
    # iota, not numpy index arrays: a warp_map body may not capture array constants
    r = lax.broadcasted_iota(jnp.int32, (mt * 128, kt * 4), 0)
    j = lax.broadcasted_iota(jnp.int32, (mt * 128, kt * 4), 1)
    return tile.at[r // 128, j // 4, r % 32, (r % 128) // 32 * 4 + j % 4].get(
        mode="promise_in_bounds")


def _stand_in_mma(acc_tmem, a_smem, b_smem, as_smem, bs_smem, deq_a, deq_b, barrier,
                  accumulate):
    """The interpreter's stand-in for one block-scaled MMA (scale copies included): the same
    arithmetic, acc (+)= (A * sa) @ (B^T * sb)^T, on the tiles and scale tiles this stage
    staged. Dequantising is exact (an FP8 value times a power of two is a float32); the plain
    MMA then accumulates in float32 into the kernel's accumulator and arrives on the stage's
    barrier when done, as the scaled one does."""
    def dequantise(x_smem, s_smem, out_smem):
        s = decode_tcgen05_scale_tile(s_smem[...]).astype(jnp.float32)
        out_smem[...] = x_smem[...].astype(jnp.float32) * jnp.repeat(s, MX_BLOCK, axis=1)

    dequantise(a_smem, as_smem, deq_a)
    dequantise(b_smem, bs_smem, deq_b)
    plgpu.commit_smem()  # generic-proxy stores before the tensor core reads them
    plgpu.tcgen05_mma(acc_tmem, deq_a, deq_b.transpose((1, 0)), barrier, accumulate=accumulate)


def _kernel(a_gmem, bt_gmem, as_gmem, bs_gmem, out_gmem,
            a_smem, b_smem, as_smem, bs_smem, as_tmem, bs_tmem, acc_tmem, out_smem,
            loaded, consumed, mma_done, deq_a=None, deq_b=None, *, config: Sm100Config,
            k_iters: int):
    tm, tn, tk, steps = config.tile_m, config.tile_n, config.tile_k, config.max_concurrent_steps
    mi, ni = lax.axis_index("m"), lax.axis_index("n")
    rows, cols = pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)
    # Scale tiles: 128 rows and 128 elements of K per [32, 16] block.
    s_rows, s_cols = pl.ds(mi * (tm // 128), tm // 128), pl.ds(ni * (tn // 128), tn // 128)

    @plgpu.warp_map
    def _per_warp(warp_id):
        @pl.when(warp_id == _TMA_WARP)
        def _load():
            def body(ki, _):
                slot = lax.rem(ki, steps)
                ks, s_ks = pl.ds(ki * tk, tk), pl.ds(ki * (tk // 128), tk // 128)

                @pl.when(ki >= steps)
                def _():  # the MMA that read this stage `steps` iterations ago is done
                    plgpu.barrier_wait(consumed.at[slot])

                plgpu.copy_gmem_to_smem(a_gmem.at[rows, ks], a_smem.at[slot], loaded.at[slot])
                plgpu.copy_gmem_to_smem(bt_gmem.at[cols, ks], b_smem.at[slot], loaded.at[slot])
                plgpu.copy_gmem_to_smem(as_gmem.at[s_rows, s_ks], as_smem.at[slot],
                                        loaded.at[slot])
                plgpu.copy_gmem_to_smem(bs_gmem.at[s_cols, s_ks], bs_smem.at[slot],
                                        loaded.at[slot])

            lax.fori_loop(0, k_iters, body, None)
            if deq_a is not None:
                # Interpreter only: it refuses to free a barrier whose waiter has not seen
                # every phase, so observe the last stages' `consumed`. On the GPU the
                # epilogue's mma_done wait already follows those MMAs; nothing is added there.
                for ki in range(max(k_iters - steps, 0), k_iters):
                    plgpu.barrier_wait(consumed.at[ki % steps])

        @pl.when(warp_id == _MMA_WARP)
        def _mma():
            def body(ki, _):
                slot = lax.rem(ki, steps)
                plgpu.barrier_wait(loaded.at[slot])
                if deq_a is None:  # the kernel (static: the interpreter allocates deq_a/deq_b)
                    # One scale buffer per operand: the copies and MMAs issued from this thread
                    # run in order on the tensor core, so the next copy cannot overtake this MMA.
                    plgpu.async_copy_scales_to_tmem(as_smem.at[slot], as_tmem)
                    plgpu.async_copy_scales_to_tmem(bs_smem.at[slot], bs_tmem)
                    plgpu.tcgen05_mma(acc_tmem, a_smem.at[slot],
                                      b_smem.at[slot].transpose((1, 0)),
                                      consumed.at[slot], a_scale=as_tmem, b_scale=bs_tmem,
                                      accumulate=ki > 0)
                else:
                    _stand_in_mma(acc_tmem, a_smem.at[slot], b_smem.at[slot], as_smem.at[slot],
                                  bs_smem.at[slot], deq_a.at[slot], deq_b.at[slot],
                                  consumed.at[slot], ki > 0)

                @pl.when(ki == k_iters - 1)
                def _():
                    plgpu.tcgen05_commit_arrive(mma_done)

            lax.fori_loop(0, k_iters, body, None)

    plgpu.barrier_wait(mma_done)
    en = config.epilogue_n
    for j in range(tn // en):  # static: tile_n / epilogue_n slices
        buf = out_smem.at[j % 2]
        buf[...] = plgpu.async_load_tmem(acc_tmem.at[:, pl.ds(j * en, en)]).astype(
            out_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf, out_gmem.at[rows, pl.ds(ni * tn + j * en, en)])
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the other buffer is free again
    plgpu.wait_load_tmem()
    plgpu.wait_smem_to_gmem(0)


def fp8_matmul_sm100(a, a_scale, bt, bt_scale, out_dtype=jnp.bfloat16, *,
                     config: Sm100Config = Sm100Config(), interpret=None):
    """a [M, K] and bt [N, K] (B transposed: K-major) in e4m3/e5m2 with MX scales a_scale
    [M, K/32] and bt_scale [N, K/32] (float8_e8m0fnu, one per 32 consecutive elements of K).
    Returns (a * a_scale) @ (bt * bt_scale).T in out_dtype, float32 accumulation.
    `interpret`: a plgpu.InterpretGPUParams to run on CPU under the Mosaic GPU interpreter,
    with `_stand_in_mma` for the block-scaled MMA the interpreter lacks."""
    m, n, k = check_kmajor_operands(a, bt)
    if a_scale.shape != (m, k // MX_BLOCK) or bt_scale.shape != (n, k // MX_BLOCK):
        raise ValueError(f"MX scales must be a_scale [{m}, {k // MX_BLOCK}] and bt_scale "
                         f"[{n}, {k // MX_BLOCK}], got {a_scale.shape} and {bt_scale.shape}")
    if a_scale.dtype != E8M0 or bt_scale.dtype != E8M0:
        raise ValueError("MX scales must be float8_e8m0fnu")
    if not supported(m, n, k, config):
        raise ValueError(f"M={m}, N={n}, K={k} must be multiples of tile_m={config.tile_m}, "
                         f"tile_n={config.tile_n}, tile_k={config.tile_k}")
    tm, tn, tk, steps = config.tile_m, config.tile_n, config.tile_k, config.max_concurrent_steps
    swizzle = plgpu.find_swizzle(tk * 8)  # 128 bytes of one-byte elements
    transforms = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    out_bytes = jnp.dtype(out_dtype).itemsize
    out_swizzle = plgpu.find_swizzle(config.epilogue_n * out_bytes * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // out_bytes)),
                      plgpu.SwizzleTransform(out_swizzle))
    scale_tile = lambda mn: plgpu.SMEM((steps, mn // 128, tk // 128, 32, 16), E8M0)  # noqa: E731
    scale_tmem = lambda mn: plgpu.TMEM((mn, tk // MX_BLOCK), E8M0,  # noqa: E731
                                       layout=plgpu.TMEMLayout.SCALES_LAYOUT)
    # Interpreter only: float32 stages for the stand-in's dequantised tiles (one per stage,
    # freed by the same `consumed` barrier as the FP8 stage it was made from).
    stand_in = {} if interpret is None else dict(
        deq_a=plgpu.SMEM((steps, tm, tk), jnp.float32),
        deq_b=plgpu.SMEM((steps, tn, tk), jnp.float32))
    kernel = plgpu.kernel(
        functools.partial(_kernel, config=config, k_iters=k // tk),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m // tm, n // tn),
        grid_names=("m", "n"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        scratch_types=dict(
            a_smem=plgpu.SMEM((steps, tm, tk), a.dtype, transforms=transforms),
            b_smem=plgpu.SMEM((steps, tn, tk), bt.dtype, transforms=transforms),
            as_smem=scale_tile(tm),
            bs_smem=scale_tile(tn),
            as_tmem=scale_tmem(tm),
            bs_tmem=scale_tmem(tn),
            acc_tmem=plgpu.TMEM((tm, tn), jnp.float32),
            out_smem=plgpu.SMEM((2, tm, config.epilogue_n), out_dtype,
                                transforms=out_transforms),
            loaded=plgpu.Barrier(num_arrivals=4, num_barriers=steps),
            consumed=plgpu.Barrier(num_arrivals=1, num_barriers=steps,
                                   orders_tensor_core=True),
            mma_done=plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
            **stand_in,
        ),
        interpret=interpret,
    )
    return kernel(a, bt, to_tcgen05_scale_layout(a_scale), to_tcgen05_scale_layout(bt_scale))
