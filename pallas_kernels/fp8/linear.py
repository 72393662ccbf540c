"""fp8_linear: y = x @ w with FP8 GEMMs in the forward and both backward products.

  forward  y  = Q4(x) @ Q4(w)           e4m3 x e4m3
  backward dx = Qg(dy) @ Q4(w)^T        Qg x e4m3
           dw = Q4(x)^T @ Qg(dy)        e4m3 x Qg

Q4 quantizes to e4m3; Qg, the gradient's quantizer, is e5m2 for the tensorwise recipes (one
scale must span the whole gradient's range: e5m2 has 32x e4m3's) and e4m3 for fp8_rowwise
and mxfp8, as torchao's rowwise recipe and NVIDIA's MXFP8 recipe (Transformer Engine's
MXFP8BlockScaling) do: with a scale per row or per 32 elements the range comes from the
scales, and e4m3's extra mantissa bit halves the rounding error of the gradients. Recipes:
  'fp8_tensorwise' current scaling, one scale per tensor from its own amax;
  'fp8_delayed'    scales from amax histories of earlier steps (meta = {'x', 'w', 'g'}, each
                   [history]); the new histories come back as meta's "gradient", which the
                   train step writes over the old ones (not through the optimizer). The
                   forward-only path leaves them alone.
  'fp8_rowwise'    one scale per row along each product's contraction axis (torchao's
                   rowwise recipe, TorchTitan's float8 "rowwise"): x per token, w per output
                   column in the forward; x and w are re-quantized per orientation in the
                   backward, as for mxfp8. Scales round up to powers of two (exact to apply,
                   never clipping a row's max).
  'mxfp8'          1x32 blocks with e8m0 scales along each product's contraction axis, so x,
                   w and dy are quantized once per orientation they are contracted in (the
                   backward re-quantizes x and w from their high-precision residuals). Scale
                   exponents round up by default (quantize_mxfp8's `rounding`).
The tensorwise recipes keep the FP8 copies of x and w as residuals (half the bytes of bf16);
fp8_rowwise and mxfp8 keep x and w as they are.
Each product names its GEMM to fp8_matmul (gemm='fprop', 'dgrad', 'wgrad'); accumulation.py
alone decides which may accumulate fast on a GPU (the forward only, as Transformer Engine).
On a GPU without block-scaled MMA (before Blackwell) 'mxfp8' is refused at trace time
(backends.mx_refusal).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.fp8.api import fp8_matmul
from pallas_kernels.fp8.backends import MX_SCALE_ROUNDINGS, RECIPES, RECIPES_TABLE
from pallas_kernels.fp8.config import E4M3, E5M2
from pallas_kernels.fp8.quant import (
    quantize_delayed,
    quantize_mxfp8,
    quantize_rowwise,
    quantize_tensorwise,
)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fp8_linear(x, w, meta, recipe, out_dtype, impl, mx_rounding):
    return _fwd(x, w, meta, recipe, out_dtype, impl, mx_rounding)[0]


def _fwd(x, w, meta, recipe, out_dtype, impl, mx_rounding):
    mm = functools.partial(fp8_matmul, impl=impl)
    r = RECIPES_TABLE[recipe]
    if r.scaling == "tensorwise" and not r.delayed:
        qx, sx = quantize_tensorwise(x, E4M3)
        qw, sw = quantize_tensorwise(w, E4M3)
        res = (qx, sx, qw, sw, None)
    elif r.delayed:
        qx, sx, hx = quantize_delayed(x, meta["x"], E4M3)
        qw, sw, hw = quantize_delayed(w, meta["w"], E4M3)
        res = (qx, sx, qw, sw, (hx, hw, meta["g"]))
    else:  # rowwise or mx: scales along K (x's axis 1, w's axis 0)
        quant = _per_axis_quantizer(r.scaling, mx_rounding)
        (qx, sx), (qw, sw) = quant(x, axis=1), quant(w, axis=0)
        res = (x, None, w, None, None)
    y = mm(qx, sx, qw, sw, out_dtype, gemm="fprop")
    # Shapes and dtypes of the primals ride along as zero-size arrays (residuals must be arrays).
    return y, (res, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _bwd(recipe, out_dtype, impl, mx_rounding, saved, g):
    (r_x, sx, r_w, sw, hist), x_like, w_like = saved
    mm = functools.partial(fp8_matmul, impl=impl)
    new_meta = None
    r = RECIPES_TABLE[recipe]
    if r.scaling in ("rowwise", "mx"):
        # Every operand e4m3, the gradient too (torchao's rowwise recipe, TE's
        # MXFP8BlockScaling): per-row or per-32 scales give the range that tensorwise recipes
        # need e5m2 for. Each operand is quantized along the axis its product contracts.
        quant = _per_axis_quantizer(r.scaling, mx_rounding)
        x, w = r_x, r_w
        qg_n, sg_n = quant(g, axis=1)  # dx contracts over N
        qw_n, sw_n = quant(w, axis=1)
        dx = mm(qg_n, sg_n, qw_n.T, sw_n.T, x_like.dtype, gemm="dgrad")
        qx_t, sx_t = quant(x, axis=0)  # dw contracts over tokens
        qg_t, sg_t = quant(g, axis=0)
        dw = mm(qx_t.T, sx_t.T, qg_t, sg_t, w_like.dtype, gemm="wgrad")
    else:
        qx, qw = r_x, r_w
        if not r.delayed:
            qg, sg = quantize_tensorwise(g, E5M2)
        else:
            hx, hw, g_hist = hist
            qg, sg, hg = quantize_delayed(g, g_hist, E5M2)
            new_meta = {"x": hx, "w": hw, "g": hg}
        dx = mm(qg, sg, qw.T, sw, x_like.dtype, gemm="dgrad")
        dw = mm(qx.T, sx, qg, sg, w_like.dtype, gemm="wgrad")
    return dx, dw, new_meta


_fp8_linear.defvjp(_fwd, _bwd)


def _per_axis_quantizer(scaling: str, mx_rounding: str):
    """quant(t, axis) -> (e4m3 q, scales along axis) for the recipes whose scales follow the
    contraction axis: one per row ('rowwise', power-of-two) or per 32 elements ('mx')."""
    if scaling == "rowwise":
        return functools.partial(quantize_rowwise, dtype=E4M3, power_of_two=True)
    return functools.partial(quantize_mxfp8, dtype=E4M3, rounding=mx_rounding)


def fp8_linear(x, w, meta=None, *, recipe: str = "fp8_tensorwise", out_dtype=None,
               impl: str = "auto", mxfp8_scale_rounding: str = "up"):
    """x [T, K] @ w [K, N] -> [T, N] in out_dtype (default x.dtype) with FP8 GEMMs.

    meta: for 'fp8_delayed', {'x', 'w', 'g'} float32 amax histories (new_fp8_meta()); None
    otherwise. Gradients: dx in x.dtype, dw in w.dtype; with 'fp8_delayed' the gradient for
    meta is the updated histories (see the module docstring). mxfp8_scale_rounding: 'up'
    (scale exponents ceil(log2(amax / 448)): no block max clipped) or 'floor' (the OCP rule);
    quantize_mxfp8 explains both. Only 'mxfp8' reads it."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; use one of {list(RECIPES)}")
    if mxfp8_scale_rounding not in MX_SCALE_ROUNDINGS:
        raise ValueError(f"unknown mxfp8_scale_rounding {mxfp8_scale_rounding!r}; use one of "
                         f"{list(MX_SCALE_ROUNDINGS)}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"fp8_linear takes x [T, K] and w [K, N], got {x.shape}, {w.shape}")
    if RECIPES_TABLE[recipe].delayed != (meta is not None):
        raise ValueError("meta (amax histories) is required for 'fp8_delayed' and only there")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    return _fp8_linear(x, w, meta, recipe, out_dtype, impl, mxfp8_scale_rounding)


def new_fp8_meta(history: int, stack: tuple[int, ...] = ()) -> dict:
    """Zeroed amax histories for one fp8_linear call site (stack: leading dims, e.g. layers)."""
    return {k: jnp.zeros((*stack, history), jnp.float32) for k in ("x", "w", "g")}
