"""FP8 training kernels: quantizers (tensorwise current/delayed scaling, rowwise, MXFP8), the FP8 matmul
(jnp reference, XLA, Pallas grid, Hopper wgmma, Blackwell block-scaled tcgen05) and
fp8_linear with its FP8 backward. backends.py holds the recipe and matmul tables.

Names load on first use (PEP 562, pallas_kernels/lazy.py): titanax.config reads the tables
(backends.py, plain data) without importing jax.
"""

from pallas_kernels.lazy import lazy_exports

_EXPORTS = {
    "fp8_matmul": ".api",
    "fp8_linear": ".linear", "new_fp8_meta": ".linear",
    "quantize_tensorwise": ".quant", "quantize_delayed": ".quant", "quantize_mxfp8": ".quant",
    "quantize_rowwise": ".quant",
    "dequantize_mxfp8": ".quant", "delayed_scale": ".quant", "update_amax_history": ".quant",
    "E4M3": ".config", "E5M2": ".config", "E8M0": ".config", "GridConfig": ".config",
    "Sm90Config": ".config", "Sm100Config": ".config",
    "RECIPES": ".backends", "MATMULS": ".backends",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
