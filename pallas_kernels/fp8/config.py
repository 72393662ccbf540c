"""FP8 formats and kernel knobs: frozen dataclasses validated on construction."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes

E4M3 = jnp.float8_e4m3fn  # weights and activations: more mantissa, max 448
E5M2 = jnp.float8_e5m2  # gradients: more range, max 57344
E8M0 = jnp.float8_e8m0fnu  # MX block scales: a bare power-of-two exponent, bias 127, 0xFF = NaN
FP8_DTYPES = (jnp.dtype(E4M3), jnp.dtype(E5M2))
MX_BLOCK = 32  # OCP Microscaling: 32 consecutive elements share one e8m0 scale

# Largest finite value and emax (exponent of the largest power of two <= max) per format.
FP8_MAX = {jnp.dtype(E4M3): 448.0, jnp.dtype(E5M2): 57344.0}
FP8_EMAX = {jnp.dtype(E4M3): 8, jnp.dtype(E5M2): 15}
assert all(float(ml_dtypes.finfo(d).max) == v for d, v in FP8_MAX.items())

# The recipe names and MX scale roundings live in backends.py (plain data titanax.config reads).
from pallas_kernels.fp8.backends import MX_SCALE_ROUNDINGS, RECIPES  # noqa: E402,F401


def check_fp8(dtype) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"expected float8_e4m3fn or float8_e5m2, got {dtype}")
    return dtype


def check_kmajor_operands(a, bt) -> tuple[int, int, int]:
    """(M, N, K) of a [M, K] and bt [N, K] (B transposed, K-major, as the GPU kernels read it),
    both e4m3/e5m2; raises naming the problem otherwise."""
    (m, k), (n, k2) = a.shape, bt.shape
    if k != k2:
        raise ValueError(f"a {a.shape} and bt {bt.shape} must share K (bt is B transposed)")
    for t in (a, bt):
        if t.dtype not in FP8_DTYPES:
            raise ValueError(f"operands must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    return m, n, k


def _check_multiple(name: str, value: int, of: int) -> None:
    if value <= 0 or value % of:
        raise ValueError(f"{name}={value} must be a positive multiple of {of}")


@dataclasses.dataclass(frozen=True)
class GridConfig:
    """Blocks of the portable Pallas grid kernel (interpret mode on CPU, Triton on GPU).
    One program per (block_m, block_n) output tile; K is walked in block_k steps inside it, so
    the accumulator stays float32 in registers and the scales are applied once at the end."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128

    def __post_init__(self):
        _check_multiple("block_m", self.block_m, 8)
        _check_multiple("block_n", self.block_n, 8)
        # MX scales cover 32 elements of K: a K step must hold whole scale blocks.
        _check_multiple("block_k", self.block_k, MX_BLOCK)


SM90_STRUCTURES = ("single_wg", "ws_2wg")  # Sm90Config.structure


@dataclasses.dataclass(frozen=True)
class Sm90Config:
    """Tiles of the Hopper wgmma kernel. wgmma has M=64 per warpgroup instruction, N up to 256
    in multiples of 8; FP8 operands must be K-major with a 128-byte swizzle, i.e. K tiles of
    128 one-byte elements.

    promote_every: FP8 wgmma adds into its accumulator with ~14 mantissa bits, not float32's
    24 (DeepSeek-V3 §3.3.2; Transformer Engine and cuBLAS call the fix "split accumulator",
    CUTLASS "fast accumulation off"). Every `promote_every` K tiles the kernel waits for the
    wgmma, adds its accumulator into a float32 register total and restarts it from zero, so
    the reduced precision only ever covers promote_every * tile_k elements of K. Default 1:
    every 128 elements (4 wgmma K=32 instructions), DeepSeek-V3's interval and CUTLASS's
    default mma_promotion_interval; at K=32768 it cuts the emulated accumulation error by two
    orders of magnitude (test_numerics.py). 0 turns it off: one accumulator over all of K,
    each wgmma kept in flight while the next stage lands.

    The total costs a second float32 tile of registers (tile_m * tile_n / 128 per thread), so
    the default tile is 64 x 128: ptxas (deviceless H100 compile) reports 141 registers and no
    spills with promote_every=1 (154 with 2, 90 with 0); 128 x 128 with promotion needs 256
    accumulator registers and spills (it compiled to 154 registers without promotion).

    structure: "single_wg" (default): matmul_sm90, one warpgroup per CTA and output tile,
    issuing both TMA and wgmma. "ws_2wg": matmul_sm90_ws, warp-specialized and persistent: a
    TMA producer warpgroup and two wgmma consumer warpgroups of tile_m / 2 = 64 rows each
    (tile_m must be 128), `num_ctas` CTAs walking the output tiles in a grouped raster
    `raster_width` tiles wide; the consumers get 232 registers per thread, so with promotion
    a 64 x tile_n half needs tile_n <= 192 (64 x 192: 192 accumulator registers), without it
    tile_n <= 256. Off by default until a GPU measures it (docs/fp8.md).
    """

    tile_m: int = 64
    tile_n: int = 128
    tile_k: int = 128
    max_concurrent_steps: int = 4  # TMA stages in flight (SMEM: steps * (tm + tn) * tk bytes)
    promote_every: int = 1  # K tiles per float32 promotion of the wgmma accumulator; 0: never
    structure: str = "single_wg"  # or "ws_2wg" (SM90_STRUCTURES)
    # ws_2wg: persistent CTAs; None: one per SM of the target GPU (132 on H100 SXM / H200, 114
    # on H100 PCIe; 132 when the count is unknown)
    num_ctas: int | None = None
    raster_width: int = 8  # ws_2wg: output-tile rows per band of the grouped raster
    # ws_2wg: the epilogue drains each consumer's 64 x tile_n result through SMEM in column
    # slices of this many, double-buffered (2 x 64 x epilogue_n per consumer instead of
    # 64 x tile_n), so the SMEM it frees holds more TMA stages; None: the whole tile at once.
    epilogue_n: int | None = None

    def __post_init__(self):
        if self.structure not in SM90_STRUCTURES:
            raise ValueError(f"structure={self.structure!r}: one of {SM90_STRUCTURES}")
        ws = self.structure == "ws_2wg"
        if ws and self.tile_m != 128:
            raise ValueError(f"tile_m={self.tile_m}: ws_2wg splits the tile's rows between "
                             "two consumer warpgroups of wgmma's M=64, so tile_m must be 128")
        if (self.num_ctas is not None and self.num_ctas < 1) or self.raster_width < 1:
            raise ValueError(f"num_ctas={self.num_ctas} and raster_width={self.raster_width} "
                             "must be >= 1")
        _check_multiple("tile_m", self.tile_m, 64)
        _check_multiple("tile_n", self.tile_n, 8)
        if self.tile_n > 256:
            raise ValueError(f"tile_n={self.tile_n}: wgmma takes N <= 256")
        _check_multiple("tile_k", self.tile_k, 128)
        if self.max_concurrent_steps < 2:
            raise ValueError("max_concurrent_steps must be >= 2 to overlap TMA and wgmma")
        if isinstance(self.promote_every, bool) or not isinstance(self.promote_every, int) \
                or self.promote_every < 0:
            raise ValueError(f"promote_every={self.promote_every!r} must be an int >= 0 (K tiles "
                             "between promotions of the wgmma accumulator; 0 turns it off)")
        # One warpgroup holds the tile: tm * tn / 128 float32 registers per thread for the
        # wgmma accumulator, as many again for the promoted total. Measured with ptxas: 192
        # (64 x 192) compiles to 204 registers, 256 (128 x 128, 64 x 256) spills at 255.
        # ws_2wg: each consumer holds tile_m / 2 rows, with 232 registers per thread.
        rows = self.tile_m // 2 if ws else self.tile_m
        acc_regs = rows * self.tile_n // 128 * (2 if self.promote_every else 1)
        if self.promote_every and acc_regs > 192:
            raise ValueError(f"tile {self.tile_m} x {self.tile_n} with promote_every="
                             f"{self.promote_every} needs {acc_regs} accumulator registers per "
                             "thread (wgmma accumulator + float32 total) and spills; use "
                             "tile_m * tile_n <= 12288 (e.g. 64 x 128) or promote_every=0")
        if self.epilogue_n is not None and (
                not ws or self.epilogue_n % 64 or self.tile_n % self.epilogue_n):
            raise ValueError(f"epilogue_n={self.epilogue_n}: the ws_2wg epilogue's column "
                             "slices must be a multiple of 64 that divides tile_n "
                             f"({self.tile_n}); None stores the whole tile")
        smem = self.max_concurrent_steps * (self.tile_m + self.tile_n) * self.tile_k
        if smem + self.epilogue_bytes() > 227 * 1024:
            raise ValueError(f"tiles need {smem} bytes of SMEM for operands plus "
                             f"{self.epilogue_bytes()} for the epilogue (float32 outputs), "
                             "over Hopper's 227 KiB: lower max_concurrent_steps, or slice the "
                             "epilogue (epilogue_n)")

    def epilogue_bytes(self, itemsize: int = 4) -> int:
        """SMEM the epilogue stages outputs of `itemsize` bytes in: the whole tile, or two
        64 x epilogue_n slices per consumer warpgroup."""
        if self.epilogue_n is None:
            return self.tile_m * self.tile_n * itemsize
        return 2 * 2 * (self.tile_m // 2) * self.epilogue_n * itemsize


@dataclasses.dataclass(frozen=True)
class Sm100Config:
    """Tiles of the Blackwell block-scaled tcgen05 kernel. The MMA takes M=128 per CTA, N a
    multiple of 16 up to 256; e8m0 scales come in tiles of 128 rows x 128 elements of K, so
    tile_m, tile_n and tile_k are multiples of 128. The float32 accumulator uses tile_n of
    TMEM's 512 columns; the scales add tile_k/32 columns each."""

    tile_m: int = 128
    tile_n: int = 256
    tile_k: int = 128
    max_concurrent_steps: int = 3  # TMA stages in flight (4 overflow SMEM at 128x256x128)
    epilogue_n: int = 64  # accumulator columns drained TMEM -> SMEM -> HBM at a time

    def __post_init__(self):
        if self.tile_m != 128:
            raise ValueError(f"tile_m={self.tile_m}: one CTA's block-scaled MMA has M=128")
        _check_multiple("tile_n", self.tile_n, 128)
        if self.tile_n > 256:
            raise ValueError(f"tile_n={self.tile_n}: tcgen05 takes N <= 256")
        _check_multiple("tile_k", self.tile_k, 128)
        _check_multiple("epilogue_n", self.epilogue_n, 16)
        if self.tile_n % self.epilogue_n:
            raise ValueError(f"epilogue_n={self.epilogue_n} must divide tile_n={self.tile_n}")
        if self.max_concurrent_steps < 2:
            raise ValueError("max_concurrent_steps must be >= 2 to overlap TMA and the MMA")
        scales = (self.tile_m + self.tile_n) // 128 * (self.tile_k // 128) * 512
        smem = self.max_concurrent_steps * ((self.tile_m + self.tile_n) * self.tile_k + scales)
        epilogue = 2 * self.tile_m * self.epilogue_n * 4
        if smem + epilogue > 227 * 1024:
            raise ValueError(f"tiles need {smem + epilogue} bytes of SMEM (operand and scale "
                             "stages plus the epilogue buffers), over Blackwell's 227 KiB; "
                             "lower max_concurrent_steps or the tiles")
