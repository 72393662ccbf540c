"""Hopper (sm_90) FP8 matmul: Pallas Mosaic GPU, TMA-pipelined wgmma on e4m3/e5m2 operands,
tensorwise or rowwise scales applied to the float32 accumulator in the epilogue.

One CTA (one warpgroup) per (tile_m, tile_n) output tile. A [M, K] and B^T [N, K] tiles stream
through `max_concurrent_steps` SMEM stages by TMA (128-byte swizzle). FP8 wgmma reads both
operands K-major, which is why B arrives as B^T: the caller quantizes W^T, so the transpose is
fused into the cast instead of costing a pass. Any mix of e4m3/e5m2 is accepted (the backward
multiplies e5m2 gradients by e4m3 weights or activations).

Accumulation (Sm90Config.promote_every): FP8 wgmma keeps only ~14 mantissa bits in its
accumulator, so by default each K tile's wgmma starts from a zero accumulator and its result
is added into a float32 register total (promotion, as DeepSeek-V3 and TE's split accumulator
do); the loads of later tiles stay in flight meanwhile. With promote_every=0 one accumulator
runs over all of K and each wgmma stays in flight while the next tiles land (delay_release=1).

Sm90Config(structure="ws_2wg") runs matmul_sm90_ws instead: a TMA producer warpgroup, two
wgmma consumer warpgroups on a 128-row tile, persistent CTAs in a grouped raster.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8.config import Sm90Config, check_kmajor_operands
from pallas_kernels.fp8.matmul_sm90_ws import fp8_matmul_sm90_ws, kernel_scales, scaled
from pallas_kernels.wgmma import wgmma_into


def supported(m: int, n: int, k: int, config: Sm90Config = Sm90Config()) -> bool:
    """Whole tiles only (no masking in this kernel); dispatch falls back otherwise."""
    return m % config.tile_m == 0 and n % config.tile_n == 0 and k % config.tile_k == 0


def _wgmma_group(acc, a_smem, bt_smem, interpret: bool):
    """acc + a_smem @ bt_smem.T (waited for)."""
    return wgmma_into(acc, lambda acc_ref: plgpu.wgmma(acc_ref, a_smem, bt_smem.T), interpret)


def _kernel(a_gmem, bt_gmem, sa_gmem, sb_gmem, out_gmem, *, config: Sm90Config, k_iters: int,
            rowwise: bool, interpret: bool):
    tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
    every = config.promote_every
    mi, ni = jax.lax.axis_index("m"), jax.lax.axis_index("n")
    swizzle = plgpu.find_swizzle(tk * 8)  # 128 bytes of one-byte elements
    transforms = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    # Without promotion a step's wgmma is still reading its SMEM stage when the step ends, so
    # the stage is released a step late (delay_release=1); promoted steps wait for theirs.
    delay = 0 if every else 1
    pipeline = functools.partial(
        plgpu.emit_pipeline, grid=(k_iters,), max_concurrent_steps=config.max_concurrent_steps,
        in_specs=[plgpu.BlockSpec((tm, tk), lambda k: (mi, k), transforms=transforms,
                                  delay_release=delay),
                  plgpu.BlockSpec((tn, tk), lambda k: (ni, k), transforms=transforms,
                                  delay_release=delay)])
    zeros = lambda: plgpu.layout_cast(jnp.zeros((tm, tn), jnp.float32), plgpu.Layout.WGMMA)

    if every == 0:  # one wgmma accumulator over all of K
        def acc_scope(acc_ref):
            def step(_, a_smem, bt_smem):
                plgpu.wgmma(acc_ref, a_smem, bt_smem.T)
                plgpu.wgmma_wait(1)  # the previous step's wgmma is done: its stage may refill

            pipeline(step)(a_gmem, bt_gmem)
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((tm, tn), jnp.float32))
    elif every == 1:
        # Each K tile (4 wgmma K=32 instructions) into a fresh zero accumulator; reading it
        # waits for the wgmma, then it joins the float32 total.
        def step(_, a_smem, bt_smem, total):
            def tile(acc_ref):
                plgpu.wgmma(acc_ref, a_smem, bt_smem.T)
                return acc_ref[...]
            return total + pl.run_scoped(tile, plgpu.ACC((tm, tn), jnp.float32))

        acc = pipeline(step, init_carry=zeros())(a_gmem, bt_gmem)
    else:
        # The partial sum carries over `every` tiles, then joins the total and restarts.
        def step(idx, a_smem, bt_smem, carry):
            total, part = carry
            part = _wgmma_group(part, a_smem, bt_smem, interpret)
            return jax.lax.cond((idx[0] + 1) % every == 0,
                                lambda t, p: (t + p, zeros()), lambda t, p: (t, p), total, part)

        total, part = pipeline(step, init_carry=(zeros(), zeros()))(a_gmem, bt_gmem)
        acc = total + part  # the last group, when every does not divide the K tiles
    out_dtype = out_gmem.dtype
    out_swizzle = plgpu.find_swizzle(tn * jnp.dtype(out_dtype).itemsize * 8)
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle // jnp.dtype(out_dtype).itemsize)),
        plgpu.SwizzleTransform(out_swizzle),
    )

    @functools.partial(pl.run_scoped,
                       o_smem=plgpu.SMEM((tm, tn), out_dtype, transforms=out_transforms))
    def _store(o_smem):
        # Epilogue: the scales (tensorwise: one float32 multiply), then the cast.
        rows, cols = pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)
        o_smem[...] = scaled(acc, sa_gmem, sb_gmem, rows, cols, rowwise).astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[pl.ds(mi * tm, tm), pl.ds(ni * tn, tn)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def fp8_matmul_sm90(a, a_scale, bt, b_scale, out_dtype=jnp.bfloat16, *,
                    config: Sm90Config = Sm90Config(), interpret=None):
    """a [M, K] and bt [N, K] (B transposed: K-major) in e4m3/e5m2; float32 scales, either
    scalars (tensorwise) or a_scale [M] per row of A and b_scale [N] per column of B
    (rowwise). Returns (a * a_scale) @ (bt * b_scale).T in out_dtype. `interpret`: a
    plgpu.InterpretGPUParams to run on CPU under the Mosaic GPU interpreter."""
    m, n, k = check_kmajor_operands(a, bt)
    if not supported(m, n, k, config):
        raise ValueError(f"M={m}, N={n}, K={k} must be multiples of tile_m={config.tile_m}, "
                         f"tile_n={config.tile_n}, tile_k={config.tile_k}")
    sa, sb, rowwise = kernel_scales(a_scale, b_scale, m, n, config)
    if config.structure == "ws_2wg":  # warp-specialized, persistent (matmul_sm90_ws.py)
        return fp8_matmul_sm90_ws(a, bt, sa, sb, out_dtype, rowwise=rowwise, config=config,
                                  interpret=interpret)
    kernel = plgpu.kernel(
        functools.partial(_kernel, config=config, k_iters=k // config.tile_k, rowwise=rowwise,
                          interpret=interpret is not None),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m // config.tile_m, n // config.tile_n),
        grid_names=("m", "n"),
        interpret=interpret,
    )
    return kernel(a, bt, sa, sb)
