"""Flash attention for titanax: Pallas kernels (Mosaic GPU sm90/sm100, Triton grid), cuDNN and
an XLA reference behind one function; see api.py and docs/attention.md."""

from .api import IMPLS, flash_attention, flash_attention_bwd, flash_attention_fwd, resolve_impl
from .config import FlashConfig, default_config
from .reference import attention_reference

__all__ = ["IMPLS", "FlashConfig", "attention_reference", "default_config", "flash_attention",
           "flash_attention_bwd", "flash_attention_fwd", "resolve_impl"]
