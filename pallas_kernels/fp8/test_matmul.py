"""FP8 matmul: every implementation against exact integer products and against the reference.

Small integers (|v| <= 16) and power-of-two scales are exact in e4m3/e5m2 and their products
and sums are exact in float32, so any correct kernel returns exactly the integer matmul.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8 import (
    GridConfig,
    fp8_matmul,
    quantize_mxfp8,
    quantize_rowwise,
    quantize_tensorwise,
)
from pallas_kernels.fp8.config import E4M3, E5M2, E8M0
from pallas_kernels.fp8.reference import fp8_matmul_reference

GRID = GridConfig(block_m=32, block_n=32, block_k=64)  # small blocks: several programs, K steps


def _ints(key, shape, dtype, lo=-8, hi=9):
    return jax.random.randint(key, shape, lo, hi).astype(jnp.float32).astype(dtype)


def _impl_kwargs(impl):
    return dict(impl="pallas_grid", config=GRID, interpret=True) if impl == "grid" else dict(impl=impl)


@pytest.mark.parametrize("impl", ["reference", "xla", "grid"])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_tensorwise_small_integers_exact(impl, dtypes):
    ka, kb = jax.random.split(jax.random.key(0))
    m, k, n = 48, 160, 40  # not multiples of the blocks: padded edges
    a, b = _ints(ka, (m, k), dtypes[0]), _ints(kb, (k, n), dtypes[1])
    sa, sb = jnp.float32(0.25), jnp.float32(8.0)
    out = fp8_matmul(a, sa, b, sb, jnp.float32, **_impl_kwargs(impl))
    want = (np.float32(a) @ np.float32(b)) * 2.0
    np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("impl", ["reference", "xla", "grid"])
def test_mx_small_integers_exact(impl):
    ka, kb, ks, kt = jax.random.split(jax.random.key(1), 4)
    m, k, n = 40, 96, 24
    a, b = _ints(ka, (m, k), E4M3), _ints(kb, (k, n), E5M2)
    # e8m0 exponents in [-3, 3] per 32-block of K: still exact.
    ea = jax.random.randint(ks, (m, k // 32), -3, 4)
    eb = jax.random.randint(kt, (k // 32, n), -3, 4)
    to_e8m0 = lambda e: jax.lax.bitcast_convert_type((e + 127).astype(jnp.uint8), E8M0)
    out = fp8_matmul(a, to_e8m0(ea), b, to_e8m0(eb), jnp.float32, **_impl_kwargs(impl))
    a64 = np.float64(a) * np.repeat(np.exp2(np.asarray(ea)), 32, axis=1)
    b64 = np.float64(b) * np.repeat(np.exp2(np.asarray(eb)), 32, axis=0)
    np.testing.assert_array_equal(np.asarray(out), (a64 @ b64).astype(np.float32))


@pytest.mark.parametrize("impl", ["reference", "xla", "grid"])
def test_rowwise_small_integers_exact(impl):
    ka, kb = jax.random.split(jax.random.key(5))
    m, k, n = 48, 96, 40  # not multiples of the grid's blocks: padded rows and columns
    a, b = _ints(ka, (m, k), E4M3), _ints(kb, (k, n), E5M2)
    # A power of two per row of a and per column of b (K = 32 too: an MX scale's shape, told
    # apart by the float32 dtype).
    sa = jnp.exp2(jnp.arange(m) % 7 - 3.0)[:, None]
    sb = jnp.exp2(jnp.arange(n) % 5 - 2.0)[None, :]
    for kk in (k, 32):
        out = fp8_matmul(a[:, :kk], sa, b[:kk], sb, jnp.float32, **_impl_kwargs(impl))
        want = (np.float32(a[:, :kk]) @ np.float32(b[:kk])) * np.asarray(sa) * np.asarray(sb)
        np.testing.assert_array_equal(np.asarray(out), want)


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise", "mx"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_grid_kernel_matches_reference(mode, out_dtype):
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (72, 200)) * 3.0  # K=200: a partial MX block at the edge
    w = jax.random.normal(kw, (200, 56)) * 0.02
    if mode == "tensorwise":
        (qa, sa), (qb, sb) = quantize_tensorwise(x, E4M3), quantize_tensorwise(w, E4M3)
    elif mode == "rowwise":
        (qa, sa), (qb, sb) = quantize_rowwise(x, axis=1), quantize_rowwise(w, axis=0)
    else:
        (qa, sa), (qb, sb) = quantize_mxfp8(x, axis=1), quantize_mxfp8(w, axis=0)
    ref = fp8_matmul_reference(qa, sa, qb, sb, jnp.float32)
    out = fp8_matmul(qa, sa, qb, sb, out_dtype, impl="pallas_grid", config=GRID, interpret=True)
    # Only the float32 summation order differs (plus the final rounding to out_dtype).
    tol = 1e-5 if out_dtype == jnp.float32 else 8e-3
    np.testing.assert_allclose(np.float32(out), np.asarray(ref), rtol=tol,
                               atol=tol * float(jnp.abs(ref).max()))
    # And the FP8 product is close to the exact one: e4m3 keeps 3 mantissa bits.
    exact = np.asarray(x) @ np.asarray(w)
    assert np.linalg.norm(np.asarray(ref) - exact) / np.linalg.norm(exact) < 0.05


def test_overflowing_and_zero_inputs_give_no_nan():
    z = jnp.zeros((32, 64))
    qa, sa = quantize_tensorwise(z, E4M3)
    big = jnp.full((64, 32), 3e38, jnp.float32)
    qb, sb = quantize_tensorwise(big, E4M3)
    out = fp8_matmul(qa, sa, qb, sb, jnp.float32, impl="pallas_grid", config=GRID, interpret=True)
    assert not np.any(np.isnan(np.asarray(out))) and not np.any(np.asarray(out))
    qa, sa = quantize_mxfp8(z, axis=1)
    qb, sb = quantize_mxfp8(big, axis=0)
    out = fp8_matmul(qa, sa, qb, sb, jnp.float32, impl="xla")
    assert not np.any(np.isnan(np.asarray(out))) and not np.any(np.asarray(out))


def test_bad_scales_are_rejected():
    a = jnp.zeros((8, 64), E4M3)
    b = jnp.zeros((64, 8), E4M3)
    with pytest.raises(ValueError, match="scales must be scalars.*rowwise.*MX"):
        fp8_matmul(a, jnp.ones((8,)), b, jnp.float32(1))
    with pytest.raises(ValueError, match="rowwise scales must be float32"):
        fp8_matmul(a, jnp.ones((8, 1), jnp.bfloat16), b, jnp.ones((1, 8)))
    e8m0 = jnp.ones((8, 1), jnp.float8_e8m0fnu)  # MX's shape at K <= 32 (and rowwise's)
    with pytest.raises(ValueError, match="MX scales must be float8_e8m0fnu"):
        fp8_matmul(a[:, :32], e8m0, b[:32], jnp.ones((1, 8)))
    with pytest.raises(ValueError, match="must be float8"):
        fp8_matmul(a.astype(jnp.bfloat16), jnp.float32(1), b, jnp.float32(1))
    with pytest.raises(ValueError, match="unknown fp8_matmul impl"):
        fp8_matmul(a, jnp.float32(1), b, jnp.float32(1), impl="cublas")


@pytest.mark.parametrize("cc, mode, ours", [((9, 0), "tensorwise", "sm90"),
                                            ((9, 0), "rowwise", "sm90"),
                                            ((10, 0), "mx", "sm100")])
def test_auto_takes_xla_until_a_recorded_benchmark_says_otherwise(monkeypatch, caplog, cc,
                                                                  mode, ours):
    from pallas_kernels import measured
    from pallas_kernels.fp8 import resolve as api
    monkeypatch.setattr(api, "compute_capability", lambda: cc)
    api._log_once.cache_clear()
    with caplog.at_level("WARNING"):
        assert api.resolve_impl("auto", mode, 1024, 1024, 1024) == "xla"
        assert api.resolve_impl("auto", mode, 1024, 1024, 1024) == "xla"
    said = [r.message for r in caplog.records if "fp8_matmul auto" in r.message]
    assert len(said) == 1 and "no benchmark" in said[0], said
    op = {"mx": "mxfp8", "tensorwise": "fp8_tensorwise", "rowwise": "fp8_rowwise"}[mode]
    monkeypatch.setitem(measured.WINS, (op, cc[0]), ours)
    assert api.resolve_impl("auto", mode, 1024, 1024, 1024) == ours
    assert api.resolve_impl("auto", mode, 1000, 1024, 1024) == "xla"  # not whole tiles
    assert api.resolve_impl(ours, mode, 1024, 1024, 1024) == ours


def test_pallas_grid_is_refused_on_gpu(monkeypatch):
    # Its Triton build spills and cannot load e8m0 scales: a GPU caller is told the paths.
    from pallas_kernels.fp8 import api
    monkeypatch.setattr(api, "target_platform", lambda: "gpu")
    a = jnp.ones((32, 64), E4M3)
    with pytest.raises(ValueError, match="not a GPU kernel.*impl='xla'"):
        fp8_matmul(a, jnp.float32(1), a.T, jnp.float32(1), impl="pallas_grid")
    # interpret=True (the CPU tests' path) stays allowed.
    out = fp8_matmul(a, jnp.float32(1), a.T, jnp.float32(1), impl="pallas_grid", config=GRID,
                     interpret=True)
    assert out.shape == (32, 32)
