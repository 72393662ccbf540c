"""Portable Pallas grid kernel for the FP8 matmul: runs in interpret mode on CPU (the kernel the
CPU tests exercise) and is the semantic twin of the GPU kernels: float32 accumulation over K
steps, tensorwise and rowwise scales applied once in the epilogue, MX e8m0 scales applied per 32-block of K
to the operand tiles before each partial product.

Grid: one program per (block_m, block_n) output tile; each holds its A row strip and B column
strip and walks K in block_k steps with a float32 carry. Shapes are zero-padded up to whole
blocks (zeros add nothing to a dot, whatever their scale).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.fp8.config import E8M0, MX_BLOCK, GridConfig
from pallas_kernels.fp8.quant import e8m0_to_float32
from pallas_kernels.fp8.reference import scaling_mode


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _pad2(x, rows: int, cols: int, value=0):
    pads = ((0, rows - x.shape[0]), (0, cols - x.shape[1]))
    if pads == ((0, 0), (0, 0)):
        return x
    return jnp.pad(x, pads, constant_values=jnp.array(value, x.dtype))


def _fp8_dot(a_ref, b_ref, shape, *, bk: int, nk: int):
    def step(i, acc):
        a = a_ref[:, pl.ds(i * bk, bk)].astype(jnp.float32)  # exact: FP8 values are f32 values
        b = b_ref[pl.ds(i * bk, bk), :].astype(jnp.float32)
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST)

    return jax.lax.fori_loop(0, nk, step, jnp.zeros(shape, jnp.float32))


def _tensorwise_kernel(s_ref, a_ref, b_ref, o_ref, *, bk: int, nk: int):
    acc = _fp8_dot(a_ref, b_ref, o_ref.shape, bk=bk, nk=nk)
    o_ref[...] = (acc * s_ref[0, 0]).astype(o_ref.dtype)  # epilogue: one multiply per output


def _rowwise_kernel(a_ref, sa_ref, b_ref, sb_ref, o_ref, *, bk: int, nk: int):
    acc = _fp8_dot(a_ref, b_ref, o_ref.shape, bk=bk, nk=nk)
    o_ref[...] = ((acc * sa_ref[...]) * sb_ref[...]).astype(o_ref.dtype)  # [bm, 1], [1, bn]


def _mx_kernel(a_ref, as_ref, b_ref, bs_ref, o_ref, *, bk: int, nk: int):
    sb = bk // MX_BLOCK  # scale columns per K step

    def step(i, acc):
        a = a_ref[:, pl.ds(i * bk, bk)].astype(jnp.float32)
        b = b_ref[pl.ds(i * bk, bk), :].astype(jnp.float32)
        sa = e8m0_to_float32(as_ref[:, pl.ds(i * sb, sb)])  # [bm, sb]
        sbb = e8m0_to_float32(bs_ref[pl.ds(i * sb, sb), :])  # [sb, bn]
        a = (a.reshape(a.shape[0], sb, MX_BLOCK) * sa[:, :, None]).reshape(a.shape)
        b = (b.reshape(sb, MX_BLOCK, b.shape[1]) * sbb[:, None, :]).reshape(b.shape)
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32,
                             precision=jax.lax.Precision.HIGHEST)

    acc = jax.lax.fori_loop(0, nk, step, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def fp8_matmul_grid(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16, *,
                    config: GridConfig = GridConfig(), interpret: bool = True):
    mode = scaling_mode(a, a_scale, b, b_scale)
    (m, k), n = a.shape, b.shape[1]
    bm = min(config.block_m, _round_up(m, 8))
    bn = min(config.block_n, _round_up(n, 8))
    bk = min(config.block_k, _round_up(k, MX_BLOCK))
    mp, np_, kp = _round_up(m, bm), _round_up(n, bn), _round_up(k, bk)
    a_p, b_p = _pad2(a, mp, kp), _pad2(b, kp, np_)
    grid = (mp // bm, np_ // bn)
    a_spec = pl.BlockSpec((bm, kp), lambda i, j: (i, 0))
    b_spec = pl.BlockSpec((kp, bn), lambda i, j: (0, j))
    out_spec = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    out_shape = jax.ShapeDtypeStruct((mp, np_), out_dtype)
    if mode == "tensorwise":
        s = (a_scale.astype(jnp.float32) * b_scale.astype(jnp.float32)).reshape(1, 1)
        out = pl.pallas_call(
            functools.partial(_tensorwise_kernel, bk=bk, nk=kp // bk),
            grid=grid, out_shape=out_shape, out_specs=out_spec, interpret=interpret,
            in_specs=[pl.BlockSpec((1, 1), lambda i, j: (0, 0)), a_spec, b_spec],
        )(s, a_p, b_p)
    elif mode == "rowwise":
        out = pl.pallas_call(
            functools.partial(_rowwise_kernel, bk=bk, nk=kp // bk),
            grid=grid, out_shape=out_shape, out_specs=out_spec, interpret=interpret,
            in_specs=[a_spec, pl.BlockSpec((bm, 1), lambda i, j: (i, 0)),
                      b_spec, pl.BlockSpec((1, bn), lambda i, j: (0, j))],
        )(a_p, _pad2(a_scale, mp, 1, 1), b_p, _pad2(b_scale, 1, np_, 1))
    else:
        one = jax.lax.bitcast_convert_type(jnp.uint8(127), E8M0)  # 2**0 for padded blocks
        kb = kp // MX_BLOCK
        as_p = _pad2(a_scale, mp, kb, one)
        bs_p = _pad2(b_scale, kb, np_, one)
        out = pl.pallas_call(
            functools.partial(_mx_kernel, bk=bk, nk=kp // bk),
            grid=grid, out_shape=out_shape, out_specs=out_spec, interpret=interpret,
            in_specs=[a_spec, pl.BlockSpec((bm, kb), lambda i, j: (i, 0)),
                      b_spec, pl.BlockSpec((kb, bn), lambda i, j: (0, j))],
        )(a_p, as_p, b_p, bs_p)
    return out[:m, :n]
