"""Quantizers against an independent numpy + ml_dtypes emulation, bit for bit.

The emulation finds exponents from the float32 bit fields (not frexp) and rounds with
ml_dtypes' float64 -> FP8 casts (not XLA's). float32 subnormal inputs are left out: XLA:CPU
flushes them to zero (DAZ), which no FP8 training tensor depends on.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.fp8 import quant
from pallas_kernels.fp8.config import E4M3, E5M2

FMT = {"e4m3": (E4M3, ml_dtypes.float8_e4m3fn, 8), "e5m2": (E5M2, ml_dtypes.float8_e5m2, 15)}


def np_tensorwise(x, np_dtype):
    fmax = np.float32(ml_dtypes.finfo(np_dtype).max)
    x32 = np.asarray(x, np.float32)
    amax = np.float32(np.max(np.abs(x32))) if x32.size else np.float32(0)
    with np.errstate(all="ignore"):
        scale = np.float32(amax / fmax)
    if not np.isfinite(scale) or scale == 0:
        scale = np.float32(1.0)
    y = np.clip(x32 / scale, -fmax, fmax)
    return y.astype(np_dtype), scale


def np_floor_log2(v):
    """floor(log2(v)) for positive float32 v from the bit fields."""
    bits = np.asarray(v, np.float32).view(np.uint32).astype(np.int64)
    exp_field, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    sub = np.array([int(m).bit_length() - 150 for m in mant.ravel()]).reshape(mant.shape)
    return np.where(exp_field > 0, exp_field - 127, sub)


def np_mxfp8(x, axis, np_dtype, emax, rounding="up"):
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    n = x.shape[-1]
    nb = -(-n // 32)
    xb = np.zeros(x.shape[:-1] + (nb * 32,), np.float32)
    xb[..., :n] = x
    xb = xb.reshape(*x.shape[:-1], nb, 32)
    amax = np.max(np.abs(xb), axis=-1)
    safe = np.where((amax > 0) & np.isfinite(amax), amax, 1.0).astype(np.float32)
    e = np_floor_log2(safe) - emax
    if rounding == "up":  # amax / 2**e > fmax iff amax's significand > fmax / 2**emax (1.75)
        sig_max = float(ml_dtypes.finfo(np_dtype).max) / 2.0 ** emax
        bits = safe.view(np.uint32).astype(np.int64)
        e = e + (((bits >> 23) & 0xFF > 0) & ((bits & 0x7FFFFF) > int((sig_max - 1) * 2 ** 23)))
    e = np.clip(e, -127, 127)
    e = np.where(amax == 0, -127, e)
    fmax = float(ml_dtypes.finfo(np_dtype).max)
    with np.errstate(all="ignore"):
        y = xb.astype(np.float64) * np.exp2(-e.astype(np.float64))[..., None]
    q = np.clip(y, -fmax, fmax).astype(np_dtype).reshape(*x.shape[:-1], nb * 32)[..., :n]
    bits = np.where(np.isfinite(amax), e + 127, 255).astype(np.uint8)
    return np.moveaxis(q, -1, axis), np.moveaxis(bits, -1, axis)


def _bits(a):
    return np.asarray(a).view(np.uint8)


def _mixed(shape, seed):
    """Normals times magnitudes from 2**-30 to 2**30: every rounding and saturation regime."""
    rng = np.random.default_rng(seed)
    mag = np.exp2(rng.integers(-30, 31, size=shape)).astype(np.float32)
    return (rng.standard_normal(shape).astype(np.float32) * mag)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("in_dtype", [np.float32, ml_dtypes.bfloat16])
def test_tensorwise_bit_exact(fmt, in_dtype):
    dt, np_dt, _ = FMT[fmt]
    for seed, x in enumerate([_mixed((64, 96), 0), np.random.default_rng(1).standard_normal((33, 7)),
                              np.zeros((8, 8)), np.array([[1e30, -3.0, 0.0]])]):
        x = np.asarray(x, np.float32).astype(in_dtype)
        q, s = quant.quantize_tensorwise(jnp.asarray(x), dt)
        q_ref, s_ref = np_tensorwise(x, np_dt)
        assert q.dtype == dt and s.dtype == jnp.float32
        np.testing.assert_array_equal(np.float32(s), s_ref)
        np.testing.assert_array_equal(_bits(q), _bits(q_ref))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_tensorwise_saturates_and_never_nan(fmt):
    dt, _, _ = FMT[fmt]
    fmax = float(ml_dtypes.finfo(FMT[fmt][1]).max)
    x = jnp.array([jnp.inf, -jnp.inf, 1.0, 0.0], jnp.float32)  # amax inf: scale falls back to 1
    q, s = quant.quantize_tensorwise(x, dt)
    assert float(s) == 1.0
    np.testing.assert_array_equal(np.float32(q), [fmax, -fmax, 1.0, 0.0])
    q0, s0 = quant.quantize_tensorwise(jnp.zeros((4, 4)), dt)
    assert float(s0) == 1.0 and not np.any(np.float32(q0))


def test_delayed_scaling_history_and_overflow():
    hist = quant.new_amax_history(3)
    x1 = jnp.full((4,), 2.0)
    q, s, hist = quant.quantize_delayed(x1, hist, E4M3)
    assert float(s) == 1.0  # empty history: unit scale
    np.testing.assert_array_equal(hist, [2.0, 0.0, 0.0])
    x2 = jnp.array([1e6, -1e6, 1.0, 0.5], jnp.float32)  # far past what the history expects
    q, s, hist = quant.quantize_delayed(x2, hist, E4M3)
    np.testing.assert_array_equal(np.float32(s), np.float32(2.0) / np.float32(448.0))
    assert not np.any(np.isnan(np.float32(q)))
    np.testing.assert_array_equal(np.float32(q)[:2], [448.0, -448.0])  # saturated, not NaN
    np.testing.assert_array_equal(hist, [1e6, 2.0, 0.0])
    _, _, hist = quant.quantize_delayed(x1, hist, E4M3)
    _, _, hist = quant.quantize_delayed(x1, hist, E4M3)
    np.testing.assert_array_equal(hist, [2.0, 2.0, 1e6])
    _, s, hist = quant.quantize_delayed(x1, hist, E4M3)
    assert float(s) == pytest.approx(1e6 / 448)  # the max over the window, then it ages out
    _, s, _ = quant.quantize_delayed(x1, hist, E4M3)
    assert float(s) == np.float32(2.0) / np.float32(448.0)


@pytest.mark.parametrize("rounding", ["up", "floor"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("shape,axis", [((64, 96), 1), ((64, 96), 0), ((5, 70), -1),
                                        ((3, 33, 4), 1)])
def test_mxfp8_bit_exact(fmt, shape, axis, rounding):
    dt, np_dt, emax = FMT[fmt]
    x = _mixed(shape, 3)
    x[0, :] = 0.0  # all-zero blocks: X = -127
    x.reshape(-1)[5] = 3.0e38  # near float32 max: X = 127 - emax (+1 rounded up)
    x.reshape(-1)[-1] = 1.1754944e-38  # smallest normal: X clamps to -127
    q, s = quant.quantize_mxfp8(jnp.asarray(x), axis=axis, dtype=dt, rounding=rounding)
    q_ref, s_ref = np_mxfp8(x, axis, np_dt, emax, rounding)
    assert q.shape == x.shape and s.dtype == jnp.float8_e8m0fnu
    assert s.shape[axis % x.ndim] == -(-x.shape[axis] // 32)  # partial edge blocks kept
    np.testing.assert_array_equal(_bits(s), s_ref)
    np.testing.assert_array_equal(_bits(q), _bits(q_ref))


def test_mxfp8_scale_choice_and_spec_saturation():
    x = jnp.zeros((32,)).at[0].set(1.0).at[1].set(-0.75).at[2].set(1.9)
    q, s = quant.quantize_mxfp8(x, dtype=E4M3, rounding="floor")
    assert _bits(s)[0] == 127 - 8 + 0  # amax 1.9 -> floor(log2) = 0 -> X = -8
    # 1.9 * 256 = 486.4 > 448: the spec's floor rule overflows the element; saturated to 448.
    np.testing.assert_array_equal(np.float32(q)[:3], [256.0, -192.0, 448.0])
    np.testing.assert_array_equal(quant.dequantize_mxfp8(q, s)[:2], [1.0, -0.75])
    # Rounded up (the default): X = ceil(log2(1.9 / 448)) = -7; 1.9 * 128 = 243.2 -> 240.
    q, s = quant.quantize_mxfp8(x, dtype=E4M3)
    assert _bits(s)[0] == 127 - 7
    np.testing.assert_array_equal(np.float32(q)[:3], [128.0, -96.0, 240.0])
    with pytest.raises(ValueError, match="MX scale rounding"):
        quant.quantize_mxfp8(x, rounding="nearest")
    bad = jnp.zeros((64,)).at[3].set(jnp.nan).at[40].set(jnp.inf)
    _, s = quant.quantize_mxfp8(bad, dtype=E4M3)
    np.testing.assert_array_equal(_bits(s), [255, 255])  # NaN scale, as the OCP spec says
    _, s = quant.quantize_mxfp8(jnp.zeros((40,)), dtype=E5M2)
    np.testing.assert_array_equal(_bits(s), [0, 0])  # all-zero blocks: 2**-127, no NaN


def _edge_blocks(rng, fmax):
    """[blocks, 32] float32: random normal blocks at magnitudes 2**-20..2**20, and blocks whose
    max sits on the rounding edges: an exact power of two, exactly fmax * 2**k (fits, both
    rules), the next float32 above it and a value between fmax and 2**(emax+1) (the floor rule
    clips both), and 2**(emax+1) * 2**k minus one float32 ulp."""
    rows = [rng.standard_normal(32) * 2.0 ** rng.integers(-20, 21) for _ in range(64)]
    for k in (-10, -3, 0, 1, 7):
        for top in (2.0 ** (k + 3), fmax * 2.0 ** k,
                    np.nextafter(np.float32(fmax * 2.0 ** k), np.float32(np.inf)),
                    fmax * 1.07 * 2.0 ** k,
                    np.nextafter(np.float32(2 * fmax / 1.75 * 2.0 ** k), np.float32(0))):
            row = rng.uniform(-1, 1, 32) * top
            row[rng.integers(32)] = -top if k % 2 else top
            rows.append(row)
    return np.asarray(rows, np.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_round_up_never_clips_a_block_max_and_both_rules_stay_accurate(fmt):
    dt, np_dt, _ = FMT[fmt]
    info = ml_dtypes.finfo(np_dt)
    fmax, mbits, emin = float(info.max), int(info.nmant), int(info.minexp)
    x = _edge_blocks(np.random.default_rng(7), fmax)
    clipped = {}
    for rounding in ("up", "floor"):
        q, s = quant.quantize_mxfp8(jnp.asarray(x), axis=1, dtype=dt, rounding=rounding)
        scale = np.asarray(quant.e8m0_to_float32(s), np.float64)  # [blocks, 1]
        y = np.abs(x.astype(np.float64)) / scale  # what the cast sees, before saturation
        clipped[rounding] = int(np.sum(y.max(axis=1) > fmax))
        # Where nothing clips, the error is the format's rounding: half an ulp, i.e.
        # 2**-(mbits+1) relative for normals and half the smallest subnormal below them.
        err = np.abs(np.asarray(quant.dequantize_mxfp8(q, s, axis=1), np.float64) - x) / scale
        bound = np.maximum(2.0 ** -(mbits + 1) * y, 2.0 ** (emin - mbits - 1))
        ok = y <= fmax
        assert np.all(err[ok] <= bound[ok]), rounding
        # Clipped elements (floor only) lose at most the 12.5% between fmax and 2**(emax+1).
        assert np.all(err[~ok] <= 0.125 * y[~ok] + 1e-12), rounding
    assert clipped["up"] == 0
    assert clipped["floor"] >= 10  # every edge block above fmax * 2**k, at each k


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("axis", [0, 1])
def test_rowwise_matches_emulation(fmt, axis):
    """A scale per slice along `axis`: each slice quantized as np_tensorwise would quantize it
    alone, with the scale rounded up to a power of two (computed here from the bit fields)."""
    dtype, np_dtype, _ = FMT[fmt]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((24, 40)).astype(np.float32)
    x *= np.exp2(rng.integers(-20, 20, (24, 1) if axis == 1 else (1, 40))).astype(np.float32)
    x[3 if axis == 1 else slice(None), slice(None) if axis == 1 else 3] = 0  # a zero slice
    q, s = quant.quantize_rowwise(jnp.asarray(x), axis=axis, dtype=dtype)
    assert s.shape == ((24, 1) if axis == 1 else (1, 40)) and s.dtype == jnp.float32
    fmax = np.float32(ml_dtypes.finfo(np_dtype).max)
    amax = np.max(np.abs(x), axis=axis, keepdims=True)
    with np.errstate(divide="ignore"):
        raw = amax / fmax
    e = np_floor_log2(np.where(raw > 0, raw, 1))
    pow2 = np.where(raw > np.exp2(e.astype(np.float32)), e + 1, e)  # round up, exact at 2**e
    want_s = np.where(amax > 0, np.exp2(pow2.astype(np.float32)), np.float32(1))
    np.testing.assert_array_equal(np.asarray(s), want_s)
    want_q = np.clip(x / want_s, -fmax, fmax).astype(np_dtype)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    # Never clipped: every slice's largest element survives within e4m3/e5m2 rounding.
    back = np.float32(np.asarray(q)) * np.asarray(s)
    assert np.all(np.abs(back).max(axis=axis) <= np.abs(x).max(axis=axis) * 1.125)
    assert np.all(np.abs(np.float32(np.asarray(q))).max(axis=axis) <= fmax)


def test_rowwise_without_power_of_two_is_tensorwise_per_row():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 32)).astype(np.float32) * np.float32([[1], [3], [1e-3], [7e2],
                                                                    [0.2], [50]])
    q, s = quant.quantize_rowwise(jnp.asarray(x), axis=1, power_of_two=False)
    for i in range(6):
        qi, si = np_tensorwise(x[i], ml_dtypes.float8_e4m3fn)
        # XLA may divide by fmax as a multiply by its reciprocal: one float32 ulp apart.
        np.testing.assert_allclose(np.float32(s[i, 0]), si, rtol=2.4e-7)
        back = np.float32(np.asarray(q[i])) * np.float32(s[i, 0])
        # e4m3 keeps 3 mantissa bits: within 2**-4 of each normal value, 2**-9 * scale below.
        assert np.all(np.abs(back - x[i]) <= 2.0**-4 * np.abs(x[i]) + 2.0**-9 * si * 1.01)
