"""Hopper FP8 accumulation: the numpy model of the wgmma accumulator (reference.py) with and
without the float32 promotion that matmul_sm90 does by default.

The model (DeepSeek-V3 §3.3.2: the FP8 wgmma accumulator keeps ~14 bits): each K=32
instruction's products summed exactly, added into an accumulator truncated to 13 fraction bits.
At K = 32768 (1024 instructions) the truncations pile up to a relative error of ~2%; promoting
every 128 elements bounds each partial to 4 truncations and the error to ~1e-4. Measured with
the operands below (max |error| / max |exact|): forward 2.2e-2 unpromoted, 1.0e-4 promoted
every 128 (ratio 217; 3.8e-4 every 512); backward dW 2.5e-2 and 9.1e-5 (ratio 269); a float32
accumulator 3e-7.
"""

import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.fp8 import Sm90Config
from pallas_kernels.fp8.reference import _truncate_mantissa, emulate_wgmma_accumulation

K = 32768  # long enough for the accumulator's lost bits to show: a 32k-token weight gradient


def _fp8(x, dtype):
    return np.asarray(x, np.float32).astype(dtype).astype(np.float64)


def _rel(x, exact):
    return float(np.max(np.abs(x - exact)) / np.max(np.abs(exact)))


def _default_interval() -> int:
    """Elements of K between promotions in the kernel's default config."""
    cfg = Sm90Config()
    return cfg.promote_every * cfg.tile_k


def test_model_truncates_toward_zero_and_is_exact_when_wide():
    one = 1.0 + 2.0 ** -13
    assert _truncate_mantissa(np.float64(one), 13) == one  # 13 fraction bits: kept
    assert _truncate_mantissa(np.float64(1.0 + 2.0 ** -14), 13) == 1.0  # 14th bit: dropped
    assert _truncate_mantissa(np.float64(-(2.0 - 2.0 ** -20)), 13) == -(2.0 - 2.0 ** -13)
    # Small integers: every sum is exact in 14 bits, so both modes give the exact product.
    rng = np.random.default_rng(0)
    a, b = rng.integers(-4, 5, (8, 256)), rng.integers(-4, 5, (256, 8))
    for every in (0, 32, 128):
        np.testing.assert_array_equal(emulate_wgmma_accumulation(a, b, every), a @ b)
    with pytest.raises(ValueError, match="multiples of 32"):
        emulate_wgmma_accumulation(a, b, 100)


@pytest.mark.parametrize("case", ["forward", "weight_gradient"])
def test_promotion_at_the_kernel_default_beats_reduced_precision_accumulation(case):
    rng = np.random.default_rng(1)
    if case == "forward":  # e4m3 x e4m3, positive means: the sums grow with K
        a = _fp8(rng.normal(0.5, 1.0, (16, K)), ml_dtypes.float8_e4m3fn)
        b = _fp8(rng.normal(0.5, 1.0, (K, 16)), ml_dtypes.float8_e4m3fn)
    else:  # dW = x^T @ dy: K is the token count; post-activation x (e4m3), dy e5m2
        a = _fp8(np.abs(rng.normal(0.0, 1.0, (16, K))) * 8, ml_dtypes.float8_e4m3fn)
        b = _fp8(rng.normal(0.2, 1.0, (K, 16)) * 1e-3, ml_dtypes.float8_e5m2)
    exact = a @ b  # float64: exact for these operands up to 2**-53
    every = _default_interval()
    assert every == 128  # DeepSeek-V3's interval: 4 wgmma instructions
    ws = Sm90Config(structure="ws_2wg", tile_m=128, tile_n=192, max_concurrent_steps=3)
    assert ws.promote_every * ws.tile_k == every  # the warp-specialized variant: the same
    plain = _rel(emulate_wgmma_accumulation(a, b, 0), exact)
    promoted = _rel(emulate_wgmma_accumulation(a, b, every), exact)
    f32 = _rel((a.astype(np.float32) @ b.astype(np.float32)).astype(np.float64), exact)
    # The figures in docs/fp8.md ("Numerics"): pytest -s -k promotion shows them.
    print(f"{case}: unpromoted {plain:.1e}, promoted every {every} {promoted:.1e}, "
          f"float32 {f32:.0e}")
    assert plain > 5e-3, plain  # the problem is real: percent-level error at K = 32768
    assert promoted < 5e-4, promoted
    assert promoted * 50 < plain, (promoted, plain)
    assert f32 < promoted  # a true float32 accumulator remains the better bound
