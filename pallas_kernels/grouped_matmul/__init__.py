"""Grouped matrix multiplication for mixture-of-experts layers: rows grouped by expert, each
group times its own weight matrix (api.grouped_matmul; backends: XLA's ragged_dot and Mosaic
GPU kernels). See api.py."""

from .api import IMPLS, grouped_matmul, resolve_impl
from .config import GroupedMatmulConfig

__all__ = ["IMPLS", "GroupedMatmulConfig", "grouped_matmul", "resolve_impl"]
