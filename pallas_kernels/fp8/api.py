"""fp8_matmul: one entry point, the kernel picked by scaling mode, platform and shape.

impl: a name in backends.py's MATMULS table (xla, reference, pallas_grid, sm90, sm100) or
'auto' (resolve.py: 'xla', the vendor path (cuBLASLt / cuDNN on GPU), unless a benchmark
recorded in docs/ shows our kernel faster on that GPU (pallas_kernels/measured.py); with
interpret=True the Pallas grid kernel in interpret mode).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.fp8.backends import IMPLS, load, matmul, mx_refusal
from pallas_kernels.fp8.reference import scaling_mode
from pallas_kernels.fp8.resolve import resolve_impl
from pallas_kernels.target import compute_capability, target_platform

__all__ = ["IMPLS", "fp8_matmul", "resolve_impl"]

_SCALES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "mx": "MX (e8m0 block)"}


def fp8_matmul(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16, *, impl: str = "auto",
               config=None, interpret=False, gemm: str = "fprop"):
    """(a * a_scale) @ (b * b_scale) -> out_dtype, float32 accumulation.

    a [M, K], b [K, N]: float8_e4m3fn or float8_e5m2 (mixed allowed). Scales: float32 scalars
    (tensorwise; x ~= q * scale), float32 a_scale [M, 1] and b_scale [1, N] (rowwise: one
    per row of a and column of b, as quantize_rowwise(a, axis=1) and
    quantize_rowwise(b, axis=0) return them) or float8_e8m0fnu a_scale [M, ceil(K/32)] and
    b_scale [ceil(K/32), N] (MXFP8: one per 32 consecutive elements of K, as
    quantize_mxfp8(a, axis=1) and quantize_mxfp8(b, axis=0) return them). `interpret`: True runs the Pallas grid kernel
    on CPU; a plgpu.InterpretGPUParams runs the sm90 kernel under the Mosaic GPU interpreter.
    gemm: which product of a linear layer this is ('fprop', 'dgrad', 'wgrad'); it sets XLA's
    accumulation (accumulation.py: fast for the forward only). MX scales on a GPU older than
    Blackwell are refused (backends.mx_refusal).
    """
    mode = scaling_mode(a, a_scale, b, b_scale)
    if mode == "mx" and not interpret and (why := mx_refusal(compute_capability())):
        raise ValueError(why)
    (m, k), n = a.shape, b.shape[1]
    impl = matmul(resolve_impl(impl, mode, m, n, k, interpret=interpret is True, config=config))
    if not impl.gpu_kernel and target_platform() == "gpu" and not interpret:
        raise ValueError(
            f"fp8_matmul impl={impl.name!r} is the portable kernel for CPU tests (interpret "
            "mode); it is not a GPU kernel: its Triton build spills (23 KB per thread at "
            "128x128x128) and cannot load e8m0 MX scales (docs/fp8.md). On a GPU use "
            "impl='xla' (cuBLASLt / cuDNN), 'sm90' (Hopper, tensorwise) or 'sm100' "
            "(Blackwell, MX)")
    if mode not in impl.scalings:
        raise ValueError(f"the {impl.name} kernel takes "
                         f"{' or '.join(_SCALES[s] for s in impl.scalings)} scales; "
                         f"{_SCALES[mode]} scales run through 'xla'")
    kw = {"gemm": gemm} if impl.takes_gemm else {}
    if impl.config is not None:
        kw["config"] = config or load(impl.config)()
    if impl.interpret == "grid":
        kw["interpret"] = bool(interpret) or target_platform() == "cpu"
    elif impl.interpret == "mosaic":  # a plgpu.InterpretGPUParams runs the Mosaic interpreter
        kw["interpret"] = None if isinstance(interpret, bool) else interpret
    if impl.k_major_b:
        # K-major B (and MX scales) as wgmma / tcgen05 read it: inside a jit the transposes
        # fuse into the producer (the cast).
        b, b_scale = b.T, (b_scale.T if mode == "mx" else b_scale)
        if mode == "rowwise":  # the GPU kernels take the scale vectors a_scale [M], b_scale [N]
            a_scale, b_scale = a_scale.reshape(-1), b_scale.reshape(-1)
    return load(impl.run)(a, a_scale, b, b_scale, out_dtype, **kw)
