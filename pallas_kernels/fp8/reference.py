"""jnp references for the FP8 matmul: what every kernel must reproduce.

Both operands are upcast to float32 (exact: an FP8 value is a float32) and multiplied with a
float32 accumulator; products of two FP8 numbers are exact in float32, so only the summation
order can differ from a kernel. Scales: tensorwise (float32 scalars) are applied once to the
accumulator, as the kernels' epilogues do; MX (e8m0, one per 32 of K) multiply the operands
block by block before the dot (exact: powers of two).

emulate_wgmma_accumulation models what the reference does not: Hopper's FP8 wgmma adding into
an accumulator of reduced precision, with and without the float32 promotion of matmul_sm90.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp8.accumulation import xla_dot_precision
from pallas_kernels.fp8.config import FP8_DTYPES, MX_BLOCK
from pallas_kernels.fp8.quant import dequantize_mxfp8
from pallas_kernels.target import target_platform


def scaling_mode(a, a_scale, b, b_scale) -> str:
    """'tensorwise' (scalar scales), 'rowwise' (float32 a_scale [M, 1] per row of a and
    b_scale [1, N] per column of b, as torch._scaled_mm takes them) or 'mx' (e8m0 scales per
    32 of K); validates shapes."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_matmul takes a [M, K] and b [K, N], got {a.shape} and {b.shape}")
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8_DTYPES:
            raise ValueError(f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    (m, k), n = a.shape, b.shape[1]
    if jnp.ndim(a_scale) == 0 and jnp.ndim(b_scale) == 0:
        return "tensorwise"
    kb = -(-k // MX_BLOCK)
    e8m0 = [jnp.dtype(s.dtype) == jnp.float8_e8m0fnu for s in (a_scale, b_scale)]
    # With K <= 32 an MX scale has rowwise's shape: the dtype tells them apart.
    if jnp.shape(a_scale) == (m, 1) and jnp.shape(b_scale) == (1, n) and not any(e8m0):
        if a_scale.dtype != jnp.float32 or b_scale.dtype != jnp.float32:
            raise ValueError("rowwise scales must be float32")
        return "rowwise"
    if jnp.shape(a_scale) == (m, kb) and jnp.shape(b_scale) == (kb, n):
        if not all(e8m0):
            raise ValueError("MX scales must be float8_e8m0fnu")
        return "mx"
    raise ValueError(f"scales must be scalars (tensorwise), float32 a_scale [{m}, 1] and "
                     f"b_scale [1, {n}] (rowwise) or e8m0 a_scale [{m}, {kb}] and b_scale "
                     f"[{kb}, {n}] (MX, one per 32 of K); got {jnp.shape(a_scale)} and "
                     f"{jnp.shape(b_scale)}")


def apply_scales(acc, a_scale, b_scale, mode: str) -> jax.Array:
    """The float32 accumulator times its scales, as the kernels' epilogues apply them:
    tensorwise both scalars in one multiply; rowwise A's row scales, then B's column scales."""
    if mode == "tensorwise":
        return acc * (a_scale.astype(jnp.float32) * b_scale.astype(jnp.float32))
    return (acc * a_scale) * b_scale


def fp8_matmul_reference(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16) -> jax.Array:
    hp = jax.lax.Precision.HIGHEST
    if (mode := scaling_mode(a, a_scale, b, b_scale)) != "mx":
        acc = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=hp)
        return apply_scales(acc, a_scale, b_scale, mode).astype(out_dtype)
    a32 = dequantize_mxfp8(a, a_scale, axis=1)
    b32 = dequantize_mxfp8(b, b_scale, axis=0)
    return jnp.dot(a32, b32, precision=hp).astype(out_dtype)


# cuDNN from which XLA lowers jax.nn.scaled_matmul to cuDNN's block-scaled GEMM (XLA's
# block-scaling rewriter, kCudnnSupportsBlockScaledDot); below it XLA dequantizes both operands
# to float32 and multiplies them with a plain dot.
CUDNN_BLOCK_SCALED_DOT = (9, 10)


def check_cudnn_block_scaled_dot() -> None:
    """Raises when the cuDNN this process loaded (the GPU's, or the CUDA plugin's in a
    deviceless compile) is older than CUDNN_BLOCK_SCALED_DOT. jax 0.11.2's CUDA plugin asks
    pip for 9.10.2 or newer, so only a system cuDNN can be older. Silent without the plugin."""
    try:
        from jax._src.lib import cuda_versions
        version = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception:  # a private module: a jax that moves it loses only this check
        version = None
    if version is not None and (version // 10000, version // 100 % 100) < CUDNN_BLOCK_SCALED_DOT:
        need = ".".join(map(str, CUDNN_BLOCK_SCALED_DOT))
        raise ValueError(f"mxfp8 needs cuDNN >= {need} for XLA's block-scaled GEMM (older cuDNN "
                         f"makes it a float32 dequantize-and-dot); this process loaded "
                         f"{version // 10000}.{version // 100 % 100}: install "
                         f"nvidia-cudnn-cu12>={need}")


def fp8_matmul_xla(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16, *,
                   gemm: str = "fprop") -> jax.Array:
    """XLA's own FP8 dot. Tensorwise and rowwise: an fp8 x fp8 dot_general with a float32
    result, scaled after: the cuBLASLt FP8 GEMM on a GPU, where it carries the precision
    accumulation.py gives `gemm` ('fprop', 'dgrad' or 'wgrad': fast accumulation for the
    forward only); on CPU a plain upcast (the reference's numbers). XLA fuses scalar scales
    into the GEMM; rowwise vectors are one elementwise pass over the float32 result, fused
    with the cast.
    MX: on a GPU jax.nn.scaled_matmul, which XLA lowers to cuDNN's block-scaled GEMM
    (`__cudnn$blockScaledDot`) on Blackwell with cuDNN >= 9.10 (checked: older raises), K
    zero-padded to whole 32-blocks; off a GPU the reference."""
    platform = target_platform()
    if (mode := scaling_mode(a, a_scale, b, b_scale)) != "mx":
        acc = jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                  precision=xla_dot_precision(gemm, platform),
                                  preferred_element_type=jnp.float32)
        return apply_scales(acc, a_scale, b_scale, mode).astype(out_dtype)
    if platform != "gpu":
        # Off GPU scaled_matmul is a slower composite of the same dequantize-and-dot.
        return fp8_matmul_reference(a, a_scale, b, b_scale, out_dtype)
    check_cudnn_block_scaled_dot()
    pad = -a.shape[1] % MX_BLOCK  # zeros in the partial last block add nothing
    if pad:
        a, b = jnp.pad(a, ((0, 0), (0, pad))), jnp.pad(b, ((0, pad), (0, 0)))
    out = jax.nn.scaled_matmul(a[None], b.T[None], a_scale[None], b_scale.T[None],
                               preferred_element_type=jnp.float32)
    return out[0].astype(out_dtype)


# --- Hopper FP8 accumulation model ---------------------------------------------------------------
WGMMA_K = 32  # K of one FP8 wgmma instruction (m64nNk32)
# Fraction bits the FP8 wgmma accumulator keeps: "around 14 bits" (DeepSeek-V3, §3.3.2),
# i.e. 13 stored bits plus the implicit leading one; float32 keeps 23.
WGMMA_ACC_MANTISSA_BITS = 13


def _truncate_mantissa(x, bits: int):
    """x (float64) rounded toward zero to `bits` fraction bits: the accumulator drops the low
    bits of each sum, it does not round them."""
    m, e = np.frexp(x)  # x = m * 2**e, |m| in [0.5, 1): bits + 1 significant bits kept
    scale = float(2 ** (bits + 1))
    return np.ldexp(np.trunc(m * scale) / scale, e)


def emulate_wgmma_accumulation(a, b, promote_every_elements: int = 0, *,
                               mantissa_bits: int = WGMMA_ACC_MANTISSA_BITS) -> np.ndarray:
    """a [M, K] @ b [K, N] as an FP8 wgmma chain computes it, in numpy float64 (a model).

    Each instruction's 32 products are summed exactly, added into the accumulator, and the
    sum truncated to `mantissa_bits` fraction bits. promote_every_elements > 0 (a multiple of
    32): every that many elements of K the accumulator is added into a float32 total (round to
    nearest) and restarts from zero, as matmul_sm90 does every promote_every * tile_k elements;
    0: one accumulator over all of K (no promotion). Returns float32 [M, N]."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    (m, k), n = a.shape, b.shape[1]
    if k % WGMMA_K or promote_every_elements < 0 or promote_every_elements % WGMMA_K:
        raise ValueError(f"K={k} and promote_every_elements={promote_every_elements} must be "
                         f"multiples of {WGMMA_K} (one wgmma instruction); 0 = no promotion")
    total = np.zeros((m, n), np.float32)
    acc = np.zeros((m, n), np.float64)
    for k0 in range(0, k, WGMMA_K):
        # FP8 products and their sum over 32 in float64: exact for e4m3 x e4m3, and within
        # 2**-53 of the largest term for wider spans (e5m2), far below the bits modelled here.
        part = a[:, k0:k0 + WGMMA_K] @ b[k0:k0 + WGMMA_K]
        acc = _truncate_mantissa(acc + part, mantissa_bits)
        if promote_every_elements and (k0 + WGMMA_K) % promote_every_elements == 0:
            total = (total.astype(np.float64) + acc).astype(np.float32)
            acc = np.zeros_like(acc)
    return (total.astype(np.float64) + acc).astype(np.float32)
