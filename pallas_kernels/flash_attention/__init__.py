"""Flash attention for titanax: Pallas kernels (Mosaic GPU sm90/sm100, Triton grid), cuDNN and
an XLA reference behind one function; see api.py, backends.py (the backend table) and
docs/attention.md. The entry point: `from pallas_kernels.flash_attention import flash_attention`.

Names load on first use (PEP 562): titanax.config reads the backend table (backends.py, plain
data) without importing jax.
"""

import importlib

_EXPORTS = {
    "IMPLS": ".backends", "BACKENDS": ".backends",
    "flash_attention": ".api", "flash_attention_bwd": ".api", "flash_attention_fwd": ".api",
    "flash_block_fwd": ".api", "flash_block_bwd": ".api", "attention_backend": ".api",
    "resolve_impl": ".resolve",
    "FlashConfig": ".config", "default_config": ".config",
    "Mask": ".mask", "attention_mask": ".mask",
    "attention_reference": ".backend_xla",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
