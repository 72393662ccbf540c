"""FP8 quantizers: tensorwise current scaling, delayed scaling with an amax history, rowwise
(one scale per row along the contraction), MXFP8.

Convention everywhere: a quantized tensor is (q, scale) with x ~= q.astype(f32) * scale, i.e.
`scale` is the dequantization factor (Transformer Engine's scale_inv). Casts saturate: a value
past the format's largest finite number becomes that number, never NaN (e4m3fn has no inf, and
an unsaturated cast of an overflow is NaN).

Why no Pallas kernel for the fused amax + cast: with current scaling the cast needs the amax
of the whole tensor first (two passes whatever the implementation), and XLA already fuses the
amax reduction into the producer and the scale-divide-clip-convert into one elementwise fusion;
with delayed scaling the scale is known up front and XLA fuses amax and cast into a single
multi-output pass. A hand kernel would only reproduce those fusions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8.config import (
    E4M3,
    E8M0,
    FP8_EMAX,
    FP8_MAX,
    MX_BLOCK,
    MX_SCALE_ROUNDINGS,
    check_fp8,
)


def amax(x) -> jax.Array:
    """max |x| in float32 (a scalar)."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)))


def scale_from_amax(amax_value, dtype=E4M3, margin: int = 0) -> jax.Array:
    """Dequantization scale mapping amax onto the format's max (times 2**margin headroom).
    An all-zero or non-finite amax gives 1.0, so zeros stay zeros and nothing divides by 0/inf.
    That fallback only keeps the arithmetic safe: a non-finite amax means an inf/NaN operand,
    which the saturating cast would otherwise hide. With delayed scaling the train step counts
    the non-finite amaxes it records (metric 'fp8_nonfinite_amax') and skips that step,
    histories included (titanax/train/step.py), so none enters a history."""
    fmax = FP8_MAX[check_fp8(dtype)]
    amax_value = jnp.asarray(amax_value, jnp.float32)
    scale = amax_value * jnp.float32(2.0 ** margin) / jnp.float32(fmax)
    ok = jnp.isfinite(scale) & (scale > 0)
    return jnp.where(ok, scale, jnp.float32(1.0))


def quantize_with_scale(x, scale, dtype=E4M3) -> jax.Array:
    """Saturating cast of x / scale to the FP8 dtype (round to nearest even, as the hardware)."""
    dtype = check_fp8(dtype)
    fmax = jnp.float32(FP8_MAX[dtype])
    y = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)
    return jnp.clip(y, -fmax, fmax).astype(dtype)


def quantize_tensorwise(x, dtype=E4M3) -> tuple[jax.Array, jax.Array]:
    """Current scaling: one float32 scale from this tensor's own amax. Returns (q, scale)."""
    scale = scale_from_amax(amax(x), dtype)
    return quantize_with_scale(x, scale, dtype), scale


def quantize_rowwise(x, axis: int = -1, dtype=E4M3,
                     power_of_two: bool = True) -> tuple[jax.Array, jax.Array]:
    """One float32 scale per slice along `axis` (the axis a matmul contracts): x [T, K] with
    axis=1 gets a scale per row [T, 1]; w [K, N] with axis=0 one per column [1, N]. Returns
    (q, scale) with the scale's `axis` kept at size 1, so q * scale broadcasts back.

    torchao's rowwise float8 recipe (TorchTitan's `float8.recipe_name="rowwise"`, also
    DeepSeek-V3's per-token activations): an outlier token or channel costs only its own
    row's resolution, where one tensorwise scale would coarsen every row. power_of_two
    (torchao's round_scales_to_power_of_2, on for that recipe): each scale rounds up to a
    power of two, so dividing by it and multiplying the float32 accumulator by it are exact
    and the row's max is never clipped. Zero or non-finite rows get scale 1 (as
    scale_from_amax)."""
    dtype = check_fp8(dtype)
    row_amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)
    scale = scale_from_amax(row_amax, dtype)
    if power_of_two:
        # scale = m * 2**e, m in [0.5, 1): the next power of two up is 2**e, or scale itself
        # when m == 0.5. Through frexp: exact, no log2 rounding.
        mant, e = jnp.frexp(scale)
        scale = jnp.ldexp(jnp.float32(1.0), jnp.where(mant == 0.5, e - 1, e))
    return quantize_with_scale(x, scale, dtype), scale


# --- delayed scaling (Transformer Engine's recipe) ---------------------------------------------
# The scale for this step comes from the max over the last `history` amaxes of earlier steps;
# this step's amax is recorded for the next one. The quantizer needs no extra pass over x to
# find its scale, at the price of saturating when values grow faster than the history.

def new_amax_history(length: int) -> jax.Array:
    if length < 1:
        raise ValueError(f"amax history length must be >= 1, got {length}")
    return jnp.zeros((length,), jnp.float32)


def update_amax_history(history, amax_value) -> jax.Array:
    """Newest amax at index 0, the oldest one drops off the end."""
    return jnp.roll(history, 1, axis=-1).at[..., 0].set(jnp.asarray(amax_value, jnp.float32))


def delayed_scale(history, dtype=E4M3, margin: int = 0) -> jax.Array:
    """Scale from the history's max (TE's amax_compute_algo='max'); 1.0 while it is all zero."""
    return scale_from_amax(jnp.max(history, axis=-1), dtype, margin)


def quantize_delayed(x, history, dtype=E4M3) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q, scale, new_history): x cast with the history's scale, its amax pushed into it."""
    scale = delayed_scale(history, dtype)
    return quantize_with_scale(x, scale, dtype), scale, update_amax_history(history, amax(x))


# --- MXFP8 (OCP Microscaling Formats v1.0) ------------------------------------------------------

def _e8m0_from_exponent(e) -> jax.Array:
    """Exponent in [-127, 127] -> e8m0 bits (bias 127), built from the integer bits: going
    through float32 would lose 2**-127 (a float32 subnormal) to flush-to-zero on XLA:CPU."""
    bits = (e + 127).astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(bits, E8M0)


def e8m0_to_float32(s) -> jax.Array:
    """2**(bits - 127) as float32 (2**-127 itself is a float32 subnormal); NaN for 0xFF."""
    bits = jax.lax.bitcast_convert_type(s, jnp.uint8).astype(jnp.int32)
    val = jnp.ldexp(jnp.float32(1.0), bits - 127)
    return jnp.where(bits == 255, jnp.float32(jnp.nan), val)


def quantize_mxfp8(x, axis: int = -1, dtype=E4M3,
                   rounding: str = "up") -> tuple[jax.Array, jax.Array]:
    """MXFP8: blocks of 32 consecutive elements along `axis` share an e8m0 scale 2**X.

    Returns (q with x's shape, scales with x's shape but ceil(n/32) along axis). rounding:
      'up'    (default; NVIDIA's MXFP8 recipe, Transformer Engine's MXFP8BlockScaling):
              X = ceil(log2(amax / fmax)), the smallest scale that leaves the block's largest
              element unclipped. Computed exactly: X0 = floor(log2 amax) - emax, plus one when
              amax * 2**-X0 > fmax (with amax = m * 2**e, m in [0.5, 1): when
              m > fmax / 2**(emax+1) = 0.875 for both formats), so nothing rounds.
      'floor' the OCP Microscaling v1.0 rule X0 = floor(log2(amax)) - emax_elem (8 for e4m3,
              15 for e5m2): amax / 2**X0 lies in [2**emax, 2**(emax+1)) and may exceed the
              format's max (448 for e4m3 above 1.75 * 2**8), which the spec leaves to saturation:
              the block maximum is clipped by up to 12.5%.
    X is clamped to e8m0's [-127, 127]; elements are x / 2**X cast with saturation. An all-zero
    block gets X = -127. A block holding NaN or inf gets the NaN scale 0xFF, as the spec
    requires. The last block along axis may be partial (zero-padded for its amax; the padding
    is not returned).
    """
    dtype = check_fp8(dtype)
    if rounding not in MX_SCALE_ROUNDINGS:
        raise ValueError(f"unknown MX scale rounding {rounding!r}; use one of "
                         f"{list(MX_SCALE_ROUNDINGS)} ('up': the block max is never clipped)")
    axis = axis % x.ndim
    n = x.shape[axis]
    nb = -(-n // MX_BLOCK)
    xf = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    lead = xf.shape[:-1]
    xb = jnp.pad(xf, [(0, 0)] * len(lead) + [(0, nb * MX_BLOCK - n)])
    xb = xb.reshape(*lead, nb, MX_BLOCK)
    block_amax = jnp.max(jnp.abs(xb), axis=-1)  # NaN propagates through max
    mant, e = jnp.frexp(block_amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2 amax) = e - 1
    emax, fmax = FP8_EMAX[dtype], jnp.float32(FP8_MAX[dtype])
    x_exp = e - 1 - emax
    if rounding == "up":
        # amax * 2**-X0 = m * 2**(emax + 1): compared through m, exact and overflow-free.
        over = mant * jnp.float32(2.0 ** (emax + 1)) > fmax
        x_exp = x_exp + over.astype(x_exp.dtype)
    x_exp = jnp.clip(x_exp, -127, 127)
    x_exp = jnp.where(block_amax == 0, -127, x_exp)
    finite = jnp.isfinite(block_amax)
    # x * 2**-X is exact (a power of two; 2**-X stays a float32 normal for every clamped X).
    y = xb * jnp.ldexp(jnp.float32(1.0), -x_exp)[..., None]
    q = jnp.clip(y, -fmax, fmax).astype(dtype)
    q = q.reshape(*lead, nb * MX_BLOCK)[..., :n]
    scales = jnp.where(finite, _e8m0_from_exponent(x_exp),
                       jax.lax.bitcast_convert_type(jnp.uint8(255), E8M0))
    return jnp.moveaxis(q, -1, axis), jnp.moveaxis(scales, -1, axis)


def dequantize_mxfp8(q, scales, axis: int = -1) -> jax.Array:
    """float32 q * 2**X, each scale repeated over its block of 32 along axis."""
    axis = axis % q.ndim
    s = jnp.repeat(e8m0_to_float32(scales), MX_BLOCK, axis=axis)
    s = jax.lax.slice_in_dim(s, 0, q.shape[axis], axis=axis)
    return q.astype(jnp.float32) * s
