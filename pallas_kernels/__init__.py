# The function shadows the subpackage attribute on purpose: pallas_kernels.flash_attention(q, k, v)
# is the stable entry point; `from pallas_kernels.flash_attention import FlashConfig` still works.
from .flash_attention import flash_attention  # noqa: E402
# FP8 training kernels: pallas_kernels.fp8.{quantize_tensorwise, quantize_mxfp8, fp8_matmul, fp8_linear}.
from . import fp8  # noqa: E402,F401
