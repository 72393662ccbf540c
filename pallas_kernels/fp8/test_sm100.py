"""Blackwell block-scaled kernel: the scale layout against the PTX ISA's description, the
wrapper's checks, the kernel's values under the Mosaic GPU interpreter with a stand-in for the
block-scaled MMA, and a deviceless B200 compile (through pallas_kernels.aot and the CUDA plugin)
that must contain the block-scaled tcgen05 MMA.

jax 0.11.2's interpreter runs neither the block-scaled tcgen05 MMA nor the SMEM -> TMEM scale
copy, so under `interpret=` the kernel swaps that one step for `_stand_in_mma` (dequantise the
staged tiles with the staged scale tiles decoded by the PTX 1X layout, plain tcgen05 MMA into
the same TMEM accumulator). Everything else runs as the kernel's own code: the TMA loads of the
A/B/scale tiles and their indices, the stage ring and barriers, the accumulate flag, the
epilogue slices. What that cannot show: that the hardware reads the scales as the ISA says."""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import Sm100Config, fp8_matmul, quantize_mxfp8
from pallas_kernels.fp8.api import resolve_impl
from pallas_kernels.fp8.config import E4M3, E5M2, E8M0, MX_BLOCK
from pallas_kernels.fp8.matmul_sm100 import (
    decode_tcgen05_scale_tile,
    fp8_matmul_sm100,
    from_tcgen05_scale_layout,
    to_tcgen05_scale_layout,
)
from pallas_kernels.fp8.reference import fp8_matmul_reference

pytestmark = pytest.mark.mosaic_interpret  # warpgroups run in the Mosaic GPU interpreter


def test_scale_layout_is_the_ptx_1x_layout():
    # PTX ISA, tcgen05 "scale factor A layout 1X": for each 128-row x 4-scale-column chunk,
    # a 32 x 16 byte tile whose row r holds rows r, r+32, r+64, r+96, 4 scale columns each.
    mn, kb = 256, 8
    s = np.arange(mn * kb, dtype=np.int32).reshape(mn, kb)
    tiles = np.asarray(to_tcgen05_scale_layout(jnp.asarray(s)))
    assert tiles.shape == (mn // 128, kb // 4, 32, 16)
    for r in range(mn):
        for j in range(kb):
            assert tiles[r // 128, j // 4, r % 32, (r % 128) // 32 * 4 + j % 4] == s[r, j]
    np.testing.assert_array_equal(np.asarray(from_tcgen05_scale_layout(jnp.asarray(tiles))), s)


def test_stand_in_scale_decode_inverts_the_layout():
    # The stand-in's own reading of the 1X layout (the ISA formula) undoes the wrapper's.
    s = jnp.arange(256 * 8, dtype=jnp.int32).reshape(256, 8)
    tiles = to_tcgen05_scale_layout(s)  # [2, 2, 32, 16]
    for kt in range(2):  # one stage's tile: all row chunks, one 128-wide K tile
        np.testing.assert_array_equal(np.asarray(decode_tcgen05_scale_tile(tiles[:, kt:kt + 1])),
                                      np.asarray(s[:, kt * 4:(kt + 1) * 4]))


# Two tilings, both with several K tiles (so the stage ring wraps) and several epilogue slices:
# 2 x 2 CTAs of 128 x 128, 4 K tiles through 2 stages, 4 slices of 32 columns; and the shipped
# 128 x 256 tile, 3 stages, 4 slices of 64, over 1 x 2 CTAs and 3 K tiles.
SMALL = Sm100Config(tile_n=128, max_concurrent_steps=2, epilogue_n=32)
SHAPES = {"small": (SMALL, 256, 256, 512), "shipped": (Sm100Config(), 128, 512, 384)}
INTERPRET = plgpu.InterpretGPUParams()


def _mx_operands(key, m, n, k, fmt_a, fmt_b):
    """Small integers (|x| <= 8) with a random power-of-two scale 2**-2..2**2 per 32-block, each
    block's exponent drawn independently, so a scale read from the wrong row or K block changes
    the result; every product and partial sum is a multiple of 2**-4 below 2**19: exact."""
    ka, kb, ksa, ksb = jax.random.split(key, 4)
    a = jax.random.randint(ka, (m, k), -8, 9).astype(jnp.float32).astype(fmt_a)
    bt = jax.random.randint(kb, (n, k), -8, 9).astype(jnp.float32).astype(fmt_b)
    sa = jnp.exp2(jax.random.randint(ksa, (m, k // MX_BLOCK), -2, 3).astype(jnp.float32))
    sb = jnp.exp2(jax.random.randint(ksb, (n, k // MX_BLOCK), -2, 3).astype(jnp.float32))
    return a, sa.astype(E8M0), bt, sb.astype(E8M0)


@pytest.mark.parametrize("fmts", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2xe4m3"])
@pytest.mark.parametrize("shape", SHAPES)
def test_sm100_interpret_exact_vs_reference(shape, fmts):
    cfg, m, n, k = SHAPES[shape]
    a, sa, bt, sb = _mx_operands(jax.random.key(m + n + k), m, n, k, *fmts)
    out = fp8_matmul_sm100(a, sa, bt, sb, jnp.float32, config=cfg, interpret=INTERPRET)
    ref = fp8_matmul_reference(a, sa, bt.T, sb.T, jnp.float32)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_sm100_interpret_random_data_bf16_out():
    # quantize_mxfp8 on normal data scaled by 2**-6..2**6 per 32-block (so the e8m0 scales
    # differ block to block); float32 sums in another order than the reference's: the bound
    # is float32 rounding over K, |err| <= 2 * K * 2**-24 * (|A| @ |B|), plus the bf16 cast.
    cfg, m, n, k = SHAPES["small"]
    kx, kw, kex, kew = jax.random.split(jax.random.key(7), 4)
    bump = lambda key, shape: jnp.repeat(jnp.exp2(jax.random.randint(  # noqa: E731
        key, shape, -6, 7).astype(jnp.float32)), MX_BLOCK, axis=1)
    x = jax.random.normal(kx, (m, k)) * bump(kex, (m, k // MX_BLOCK))
    w_t = jax.random.normal(kw, (n, k)) * bump(kew, (n, k // MX_BLOCK))
    (qa, sa), (qbt, sbt) = quantize_mxfp8(x, axis=1), quantize_mxfp8(w_t, axis=1)
    assert len(np.unique(np.asarray(sa.astype(jnp.float32)))) > 8  # non-trivial scales
    out = fp8_matmul_sm100(qa, sa, qbt, sbt, jnp.bfloat16, config=cfg, interpret=INTERPRET)
    ref = fp8_matmul_reference(qa, sa, qbt.T, sbt.T, jnp.float32)
    a32 = np.abs(np.asarray(qa, np.float32) * np.repeat(np.float32(sa), MX_BLOCK, 1))
    b32 = np.abs(np.asarray(qbt, np.float32) * np.repeat(np.float32(sbt), MX_BLOCK, 1))
    bound = 2 * k * 2.0**-24 * (a32 @ b32.T) + 2.0**-8 * np.abs(np.asarray(ref))
    err = np.abs(np.float32(out) - np.asarray(ref))
    assert (err <= bound).all(), float((err / bound).max())


def test_sm100_interpret_seam_off_by_default():
    # The stand-in's float32 stages exist only under the interpreter: the compiled kernel's
    # scratch (and so its SMEM budget and code) is the block-scaled one.
    cfg, m, n, k = SMALL, 128, 128, 128
    a, sa, bt, sb = _mx_operands(jax.random.key(0), m, n, k, E4M3, E4M3)
    text = str(jax.make_jaxpr(lambda *x: fp8_matmul_sm100(*x, config=cfg))(a, sa, bt, sb))
    assert "async_copy_scales_to_tmem" in text and "f32[2,128,128]" not in text


def test_sm100_wrapper_checks_and_dispatch():
    a = jnp.zeros((128, 256), E4M3)
    good = jnp.ones((128, 8), E8M0)
    with pytest.raises(ValueError, match="share K"):
        fp8_matmul_sm100(a, good, jnp.zeros((256, 128), E4M3), good)
    with pytest.raises(ValueError, match="MX scales must be"):
        fp8_matmul_sm100(a, good, jnp.zeros((256, 256), E4M3), good)
    with pytest.raises(ValueError, match="multiples of tile_m"):
        fp8_matmul_sm100(a, good, jnp.zeros((128, 256), E4M3), good)  # N=128 < tile_n=256
    with pytest.raises(ValueError, match="MX"):
        fp8_matmul(a, jnp.float32(1), jnp.zeros((256, 256), E4M3), jnp.float32(1), impl="sm100")
    assert resolve_impl("auto", "mx", 256, 256, 256) == "xla"  # CPU: no Blackwell here


def test_sm100_config_validation():
    with pytest.raises(ValueError, match="M=128"):
        Sm100Config(tile_m=256)
    with pytest.raises(ValueError, match="227 KiB"):
        Sm100Config(max_concurrent_steps=4)  # 128 x 256 x 128 stages: 4 do not fit
    with pytest.raises(ValueError, match="divide tile_n"):
        Sm100Config(tile_n=256, epilogue_n=96)


def test_sm100_compiles_for_b200_without_gpu():
    from pallas_kernels import aot

    if not aot.plugin_available():
        pytest.skip("CUDA plugin not installed (`bash scripts/dev.sh cuda-plugin` installs it into .venv/cuda-plugin)")
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from pallas_kernels import aot
        from pallas_kernels.fp8 import fp8_matmul
        S = jax.ShapeDtypeStruct
        M, N, K = 256, 512, 1024
        def f(a, sa, b, sb):
            return fp8_matmul(a, sa, b, sb, jnp.bfloat16, impl="sm100")
        c = aot.compile_for("b200", f, S((M, K), jnp.float8_e4m3fn),
                            S((M, K // 32), jnp.float8_e8m0fnu), S((K, N), jnp.float8_e5m2),
                            S((K // 32, N), jnp.float8_e8m0fnu))
        txt = c.as_text()
        assert 'custom_call_target="mosaic_gpu' in txt, "no Mosaic GPU kernel in the HLO"
        assert "kind::mxf8f6f4.block_scale.scale_vec::1X" in txt, "no block-scaled tcgen05 MMA"
        print("OK")
    """)
    r = aot.run_script(script)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
