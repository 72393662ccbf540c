"""jnp references for the FP8 matmul: what every kernel must reproduce.

Both operands are upcast to float32 (exact: an FP8 value is a float32) and multiplied with a
float32 accumulator; products of two FP8 numbers are exact in float32, so only the summation
order can differ from a kernel. Scales: tensorwise (float32 scalars) are applied once to the
accumulator, as the kernels' epilogues do; MX (e8m0, one per 32 of K) multiply the operands
block by block before the dot (exact: powers of two).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8.config import FP8_DTYPES, MX_BLOCK
from pallas_kernels.fp8.quant import dequantize_mxfp8
from pallas_kernels.target import target_platform


def scaling_mode(a, a_scale, b, b_scale) -> str:
    """'tensorwise' (scalar scales) or 'mx' (e8m0 scales per 32 of K); validates shapes."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_matmul takes a [M, K] and b [K, N], got {a.shape} and {b.shape}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8_DTYPES:
            raise ValueError(f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    (m, k), n = a.shape, b.shape[1]
    if jnp.ndim(a_scale) == 0 and jnp.ndim(b_scale) == 0:
        return "tensorwise"
    kb = -(-k // MX_BLOCK)
    if jnp.shape(a_scale) == (m, kb) and jnp.shape(b_scale) == (kb, n):
        if a_scale.dtype != jnp.float8_e8m0fnu or b_scale.dtype != jnp.float8_e8m0fnu:
            raise ValueError("MX scales must be float8_e8m0fnu")
        return "mx"
    raise ValueError(f"scales must be scalars (tensorwise) or a_scale [{m}, {kb}] and b_scale "
                     f"[{kb}, {n}] (MX, one per 32 of K); got {jnp.shape(a_scale)} and "
                     f"{jnp.shape(b_scale)}")


def fp8_matmul_reference(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16) -> jax.Array:
    hp = jax.lax.Precision.HIGHEST
    if scaling_mode(a, a_scale, b, b_scale) == "tensorwise":
        acc = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=hp)
        return (acc * (a_scale.astype(jnp.float32) * b_scale.astype(jnp.float32))).astype(out_dtype)
    a32 = dequantize_mxfp8(a, a_scale, axis=1)
    b32 = dequantize_mxfp8(b, b_scale, axis=0)
    return jnp.dot(a32, b32, precision=hp).astype(out_dtype)


def fp8_matmul_xla(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16) -> jax.Array:
    """XLA's own FP8 dot. Tensorwise: an fp8 x fp8 dot_general with a float32 result, scaled
    after; on Hopper XLA rewrites this pattern to a cuBLASLt FP8 GEMM with the scales fused,
    on CPU it upcasts (same numbers as the reference). MX: jax.nn.scaled_matmul (cuDNN's
    block-scaled GEMM on Blackwell), which needs K to be a whole number of 32-blocks; other K,
    and CPU, go through the reference."""
    if scaling_mode(a, a_scale, b, b_scale) == "tensorwise":
        acc = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        scale = a_scale.astype(jnp.float32) * b_scale.astype(jnp.float32)
        return (acc * scale).astype(out_dtype)
    if a.shape[1] % MX_BLOCK or target_platform() == "cpu":
        # Off GPU scaled_matmul is a slower composite of the same dequantize-and-dot.
        return fp8_matmul_reference(a, a_scale, b, b_scale, out_dtype)
    out = jax.nn.scaled_matmul(a[None], b.T[None], a_scale[None], b_scale.T[None],
                               preferred_element_type=jnp.float32)
    return out[0].astype(out_dtype)
