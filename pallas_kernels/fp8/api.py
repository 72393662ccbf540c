"""fp8_matmul: one entry point, the kernel picked by scaling mode, platform and shape.

impl:
  'auto'        'xla' (the vendor path: cuBLASLt / cuDNN on GPU) unless a benchmark recorded in
                docs/ shows our kernel faster on that GPU (pallas_kernels/measured.py): then
                the wgmma kernel (sm_90, tensorwise) or the tcgen05 one (sm_100, MX).
                With interpret=True: the Pallas grid kernel in interpret mode.
  'xla'         XLA's own FP8 dot (cuBLASLt on Hopper; jax.nn.scaled_matmul for MX).
  'reference'   jnp upcast-and-dot (reference.py).
  'pallas_grid' the portable Pallas grid kernel (matmul_grid.py).
  'sm90'        the Hopper Mosaic GPU kernel (tensorwise only).
  'sm100'       the Blackwell Mosaic GPU kernel (MX only: tcgen05 with e8m0 block scales).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from pallas_kernels.fp8 import matmul_grid, matmul_sm90, matmul_sm100
from pallas_kernels.fp8.config import GridConfig, Sm90Config, Sm100Config
from pallas_kernels.fp8.reference import fp8_matmul_reference, fp8_matmul_xla, scaling_mode
from pallas_kernels import measured
from pallas_kernels.target import compute_capability, target_platform

log = logging.getLogger(__name__)

IMPLS = ("auto", "xla", "reference", "pallas_grid", "sm90", "sm100")


def resolve_impl(impl: str, mode: str, m: int, n: int, k: int, *, interpret: bool = False,
                 config=None) -> str:
    """The kernel 'auto' means: XLA's FP8 dot (cuBLASLt) for tensorwise scales and XLA's scaled
    matmul (cuDNN) for MX ones, unless a benchmark recorded in docs/ shows our kernel faster on
    this GPU (pallas_kernels/measured.py) and it takes the shape. Logged once per choice."""
    if impl not in IMPLS:
        raise ValueError(f"unknown fp8_matmul impl {impl!r}; use one of {list(IMPLS)}")
    if impl != "auto":
        return impl
    if interpret:
        return "pallas_grid"
    cc = compute_capability()
    if cc is None:
        return "xla"
    op = "mxfp8" if mode == "mx" else "fp8_tensorwise"
    ours = _our_kernel(cc, mode, m, n, k, config)
    if ours is not None and measured.ours_won(op, cc, ours):
        _log_once(f"fp8_matmul auto: using {ours!r} for {op}: {measured.WHERE} records it "
                  f"beating XLA on compute capability {cc[0]}.{cc[1]}")
        return ours
    _log_once(f"fp8_matmul auto: using 'xla' for {op} on compute capability {cc[0]}.{cc[1]}: "
              f"no benchmark in {measured.WHERE} shows a titanax kernel faster there (ours "
              "stay one impl= away: sm90, sm100, pallas_grid)")
    return "xla"


def _our_kernel(cc, mode: str, m: int, n: int, k: int, config) -> str | None:
    """Our Mosaic kernel for this GPU generation and scaling mode when it takes the shape."""
    if cc[0] == 9 and mode == "tensorwise":
        cfg = config if isinstance(config, Sm90Config) else Sm90Config()
        return "sm90" if matmul_sm90.supported(m, n, k, cfg) else None
    if cc[0] == 10 and mode == "mx":
        cfg = config if isinstance(config, Sm100Config) else Sm100Config()
        return "sm100" if matmul_sm100.supported(m, n, k, cfg) else None
    return None


@functools.cache
def _log_once(msg: str) -> None:
    log.warning(msg)


def fp8_matmul(a, a_scale, b, b_scale, out_dtype=jnp.bfloat16, *, impl: str = "auto",
               config=None, interpret=False):
    """(a * a_scale) @ (b * b_scale) -> out_dtype, float32 accumulation.

    a [M, K], b [K, N]: float8_e4m3fn or float8_e5m2 (mixed allowed). Scales: float32 scalars
    (tensorwise; x ~= q * scale) or float8_e8m0fnu a_scale [M, ceil(K/32)] and b_scale
    [ceil(K/32), N] (MXFP8: one per 32 consecutive elements of K, as quantize_mxfp8(a, axis=1)
    and quantize_mxfp8(b, axis=0) return them). `interpret`: True runs the Pallas grid kernel
    on CPU; a plgpu.InterpretGPUParams runs the sm90 kernel under the Mosaic GPU interpreter.
    """
    mode = scaling_mode(a, a_scale, b, b_scale)
    (m, k), n = a.shape, b.shape[1]
    impl = resolve_impl(impl, mode, m, n, k, interpret=interpret is True, config=config)
    if impl == "reference":
        return fp8_matmul_reference(a, a_scale, b, b_scale, out_dtype)
    if impl == "xla":
        return fp8_matmul_xla(a, a_scale, b, b_scale, out_dtype)
    if impl == "pallas_grid":
        if target_platform() == "gpu" and not interpret:
            raise ValueError(
                "fp8_matmul impl='pallas_grid' is the portable kernel for CPU tests (interpret "
                "mode); it is not a GPU kernel: its Triton build spills (23 KB per thread at "
                "128x128x128) and cannot load e8m0 MX scales (docs/fp8.md). On a GPU use "
                "impl='xla' (cuBLASLt / cuDNN), 'sm90' (Hopper, tensorwise) or 'sm100' "
                "(Blackwell, MX)")
        return matmul_grid.fp8_matmul_grid(a, a_scale, b, b_scale, out_dtype,
                                           config=config or GridConfig(),
                                           interpret=bool(interpret) or target_platform() == "cpu")
    if impl == "sm100":
        if mode != "mx":
            raise ValueError("the sm100 kernel takes MX (e8m0 block) scales; tensorwise runs "
                             "through 'xla' on Blackwell")
        # K-major B and its scales, as tcgen05 reads them; the transposes fuse into the cast.
        return matmul_sm100.fp8_matmul_sm100(a, a_scale, b.T, b_scale.T, out_dtype,
                                             config=config or Sm100Config())
    gpu_interpret = None if isinstance(interpret, bool) else interpret
    if mode != "tensorwise":
        raise ValueError("the sm90 kernel takes tensorwise scales; MX runs through 'xla'")
    # K-major B for wgmma: inside a jit the transpose fuses into the producer (the cast).
    return matmul_sm90.fp8_matmul_sm90(a, a_scale, b.T, b_scale, out_dtype,
                                       config=config or Sm90Config(), interpret=gpu_interpret)
