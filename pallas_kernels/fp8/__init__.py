"""FP8 training kernels: quantizers (tensorwise current/delayed scaling, MXFP8), the FP8 matmul
(jnp reference, XLA, Pallas grid, Hopper wgmma, Blackwell block-scaled tcgen05) and
fp8_linear with its FP8 backward."""

from pallas_kernels.fp8.api import fp8_matmul
from pallas_kernels.fp8.config import E4M3, E5M2, E8M0, GridConfig, Sm90Config, Sm100Config
from pallas_kernels.fp8.linear import fp8_linear, new_fp8_meta
from pallas_kernels.fp8.quant import (delayed_scale, dequantize_mxfp8, quantize_delayed,
                                      quantize_mxfp8, quantize_tensorwise, update_amax_history)

__all__ = ["fp8_matmul", "fp8_linear", "new_fp8_meta", "quantize_tensorwise", "quantize_delayed",
           "quantize_mxfp8", "dequantize_mxfp8", "delayed_scale", "update_amax_history",
           "E4M3", "E5M2", "E8M0", "GridConfig", "Sm90Config", "Sm100Config"]
