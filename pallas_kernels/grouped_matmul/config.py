"""Tiles and pipeline depth of the Mosaic GPU grouped matmul (api.py, impl mosaic_sm90), checked
when built rather than deep inside a kernel compile."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GroupedMatmulConfig:
    block_m: int = 128  # rows per output tile (two wgmma row groups of 64)
    block_n: int = 128  # output columns per tile
    block_k: int = 64  # contraction step: one 128-byte swizzle row of bf16
    max_concurrent_steps: int = 4  # TMA pipeline depth
    grid_block_n: int = 1  # output tiles along N walked together (the forward's raster)

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 64 or v % 64:
                raise ValueError(f"GroupedMatmulConfig.{name}={v!r}: must be a multiple of 64 "
                                 "(wgmma tiles and 128-byte swizzle rows)")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"GroupedMatmulConfig.max_concurrent_steps="
                             f"{self.max_concurrent_steps}: the TMA pipeline needs at least 2")
        if self.grid_block_n < 1:
            raise ValueError(f"GroupedMatmulConfig.grid_block_n={self.grid_block_n}: must be >= 1")
