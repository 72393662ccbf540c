"""Flash attention for titanax: Pallas kernels (Mosaic GPU sm90/sm100, Triton grid), cuDNN and
an XLA reference behind one function; see api.py, backends.py (the backend table) and
docs/attention.md. The entry point: `from pallas_kernels.flash_attention import flash_attention`.

Names load on first use (PEP 562, pallas_kernels/lazy.py): titanax.config reads the backend
table (backends.py, plain data) without importing jax.
"""

from pallas_kernels.lazy import lazy_exports

_EXPORTS = {
    "IMPLS": ".backends", "BACKENDS": ".backends",
    "flash_attention": ".api", "flash_attention_bwd": ".api", "flash_attention_fwd": ".api",
    "flash_block_fwd": ".api", "flash_block_bwd": ".api", "attention_backend": ".api",
    "resolve_impl": ".resolve",
    "FlashConfig": ".config", "default_config": ".config",
    "Mask": ".mask", "attention_mask": ".mask",
    "attention_reference": ".backend_xla",
}

__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
