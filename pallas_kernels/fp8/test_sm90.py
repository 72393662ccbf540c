"""Hopper wgmma kernel: run under the Mosaic GPU interpreter on CPU (small shapes), and compiled
for an H100 without a GPU (deviceless, through pallas_kernels.aot and the CUDA plugin), where
ptxas must report no register spills at the default config (accumulator promotion on)."""

import dataclasses
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import Sm90Config, fp8_matmul, quantize_tensorwise
from pallas_kernels.fp8.config import E4M3, E5M2
from pallas_kernels.fp8.matmul_sm90 import fp8_matmul_sm90
from pallas_kernels.fp8.reference import fp8_matmul_reference

pytestmark = pytest.mark.mosaic_interpret  # warpgroups run in the Mosaic GPU interpreter

CFG = Sm90Config(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2)
# The warp-specialized persistent variant on small tiles: 3 CTAs over 4 or 6 output tiles, so
# some CTAs take two tiles (the producer running into the next tile) and the raster wraps.
WS = Sm90Config(structure="ws_2wg", tile_m=128, tile_n=64, tile_k=128, max_concurrent_steps=2,
                num_ctas=3, raster_width=2)


def _ints(key, shape, dtype):
    """Small integers: every product and sum is exact, so kernels must match bit for bit."""
    return jax.random.randint(key, shape, -8, 9).astype(jnp.float32).astype(dtype)


def _check_exact(cfg, a, b):
    """The interpreted kernel on integer operands, scales 0.5 and 4: bit for bit a @ b * 2."""
    out = fp8_matmul(a, jnp.float32(0.5), b, jnp.float32(4.0), jnp.float32, impl="sm90",
                     config=cfg, interpret=plgpu.InterpretGPUParams())
    np.testing.assert_array_equal(np.asarray(out), (np.float32(a) @ np.float32(b)) * 2.0)


# promote_every: 0 (one accumulator), 1 (the default: every K tile), 3 over 4 K tiles (a full
# promotion group, then a partial one left in the accumulator at the end).
@pytest.mark.parametrize("promote_every,k", [(0, 256), (1, 256), (3, 512)])
def test_sm90_interpret_exact_and_mixed_formats(promote_every, k):
    ka, kb = jax.random.split(jax.random.key(0))
    _check_exact(dataclasses.replace(CFG, promote_every=promote_every),
                 _ints(ka, (128, k), E4M3), _ints(kb, (k, 64), E5M2))


@pytest.mark.parametrize("cfg, m", [(CFG, 64), (WS, 256)], ids=["single_wg", "ws_2wg"])
def test_interpret_matches_reference_bf16_out(cfg, m):
    kx, kw = jax.random.split(jax.random.key(1))
    (qa, sa) = quantize_tensorwise(jax.random.normal(kx, (m, 256)), E4M3)
    (qb, sb) = quantize_tensorwise(jax.random.normal(kw, (256, 128)) * 0.02, E4M3)
    out = fp8_matmul(qa, sa, qb, sb, jnp.bfloat16, impl="sm90", config=cfg,
                     interpret=plgpu.InterpretGPUParams())
    ref = fp8_matmul_reference(qa, sa, qb, sb, jnp.float32)
    np.testing.assert_allclose(np.float32(out), np.asarray(ref), rtol=8e-3,
                               atol=8e-3 * float(jnp.abs(ref).max()))


# e4m3 x e4m3 (forward) and e5m2 x e4m3 (a gradient times weights or activations), the
# promotion every K tile (default), every 2 of 3 (a partial group left at the end) or never.
@pytest.mark.parametrize("fmt_a,promote_every,m,n,k", [
    (E4M3, 1, 256, 128, 256), (E5M2, 1, 384, 128, 128), (E4M3, 2, 256, 128, 384),
    (E5M2, 0, 256, 128, 256)])
def test_ws_2wg_interpret_exact(fmt_a, promote_every, m, n, k):
    ka, kb = jax.random.split(jax.random.key(2))
    _check_exact(dataclasses.replace(WS, promote_every=promote_every),
                 _ints(ka, (m, k), fmt_a), _ints(kb, (k, n), E4M3))



# The epilogue in column slices (Sm90Config.epilogue_n): 3 slices of 64 per 192-column tile
# (an odd count, so a CTA's next tile starts on the slot its last slice used) and 4 output
# tiles over 3 CTAs (one CTA takes two); rowwise scales through the same slices.
@pytest.mark.parametrize("rowwise", [False, True])
def test_ws_2wg_sliced_epilogue_exact(rowwise):
    ka, kb = jax.random.split(jax.random.key(3))
    m, n, k = 256, 384, 256
    cfg = dataclasses.replace(WS, tile_n=192, epilogue_n=64, promote_every=0)
    a, bt = _ints(ka, (m, k), E4M3), _ints(kb, (n, k), E5M2)
    sa, sb = ((jnp.exp2(jnp.arange(m) % 5 - 2.0), jnp.exp2(jnp.arange(n) % 3 - 1.0)) if rowwise
              else (jnp.float32(0.5), jnp.float32(4.0)))
    out = fp8_matmul_sm90(a, sa, bt, sb, jnp.float32, config=cfg,
                          interpret=plgpu.InterpretGPUParams())
    exact = (np.float32(a) @ np.float32(bt).T) * (
        np.asarray(sa)[:, None] * np.asarray(sb) if rowwise else 2.0)
    np.testing.assert_array_equal(np.asarray(out), exact)


# Rowwise scales through fp8_matmul (a_scale [M, 1], b_scale [1, N], as quantize_rowwise
# returns them) into both structures: each tile's rows and columns get their own scales.
@pytest.mark.parametrize("cfg", [CFG, WS], ids=["single_wg", "ws_2wg"])
def test_rowwise_scales_exact(cfg):
    ka, kb = jax.random.split(jax.random.key(4))
    m, n, k = 256, 128, 256
    a, b = _ints(ka, (m, k), E4M3), _ints(kb, (k, n), E5M2)
    # Powers of two per row of A and column of B: the scaled products stay exact.
    sa, sb = jnp.exp2(jnp.arange(m) % 5 - 2.0)[:, None], jnp.exp2(jnp.arange(n) % 3 - 1.0)[None]
    out = fp8_matmul(a, sa, b, sb, jnp.float32, impl="sm90", config=cfg,
                     interpret=plgpu.InterpretGPUParams())
    exact = (np.float32(a) @ np.float32(b)) * np.asarray(sa) * np.asarray(sb)
    np.testing.assert_array_equal(np.asarray(out), exact)


def test_rowwise_scale_shapes_and_spilling_tiles_are_refused():
    a, bt = jnp.zeros((256, 256), E4M3), jnp.zeros((128, 256), E5M2)
    with pytest.raises(ValueError, match=r"a_scale \[M=256\] and b_scale \[N=128\]"):
        fp8_matmul_sm90(a, jnp.ones(64), bt, jnp.ones(128), jnp.float32, config=WS)
    wide = dataclasses.replace(WS, tile_n=128 + 64, max_concurrent_steps=2)
    with pytest.raises(ValueError, match="tile_n <= 128"):
        fp8_matmul_sm90(a, jnp.ones(256), jnp.zeros((192, 256), E5M2), jnp.ones(192),
                        config=wide)


def test_sm90_config_validation():
    with pytest.raises(ValueError, match="tile_k"):
        Sm90Config(tile_k=64)  # FP8 wgmma needs the 128-byte swizzle: K tiles of 128
    with pytest.raises(ValueError, match="227 KiB"):
        Sm90Config(tile_m=256, tile_n=256, tile_k=256, max_concurrent_steps=4, promote_every=0)
    # Promotion keeps a second float32 tile in registers: 128 x 128 spills (ptxas, 255 regs).
    with pytest.raises(ValueError, match="spills.*promote_every=0"):
        Sm90Config(tile_m=128, tile_n=128)
    assert Sm90Config(tile_m=128, tile_n=128, promote_every=0).promote_every == 0
    with pytest.raises(ValueError, match="promote_every"):
        Sm90Config(promote_every=-1)
    assert Sm90Config().structure == "single_wg"  # ws_2wg is opt-in until a GPU measures it
    with pytest.raises(ValueError, match="structure"):
        Sm90Config(structure="pingpong")
    with pytest.raises(ValueError, match="tile_m must be 128"):
        Sm90Config(structure="ws_2wg", tile_m=64)
    # Two consumers of 64 rows each: promotion fits 128 x 192 (192 accumulator registers),
    # not 128 x 256 (256), which only runs with promote_every=0.
    Sm90Config(structure="ws_2wg", tile_m=128, tile_n=192, max_concurrent_steps=3)
    with pytest.raises(ValueError, match="spills"):
        Sm90Config(structure="ws_2wg", tile_m=128, tile_n=256)
    Sm90Config(structure="ws_2wg", tile_m=128, tile_n=256, max_concurrent_steps=2,
               promote_every=0)
    with pytest.raises(ValueError, match="num_ctas"):
        Sm90Config(structure="ws_2wg", tile_m=128, num_ctas=0)
    # A sliced epilogue frees SMEM for a third stage at 128 x 256 (float32 outputs sized)
    with pytest.raises(ValueError, match="227 KiB.*epilogue_n"):
        Sm90Config(structure="ws_2wg", tile_m=128, tile_n=256, max_concurrent_steps=3,
                   promote_every=0)
    Sm90Config(structure="ws_2wg", tile_m=128, tile_n=256, max_concurrent_steps=3,
               promote_every=0, epilogue_n=64)
    for bad in ({"epilogue_n": 96}, {"epilogue_n": 64, "structure": "single_wg", "tile_m": 64}):
        with pytest.raises(ValueError, match="epilogue_n"):
            Sm90Config(**{"structure": "ws_2wg", "tile_m": 128, "tile_n": 128, **bad,
                          "promote_every": 0})


# (config, rowwise scales, wgmma instruction): the shipped kernel and the ws_2wg variant at the
# tiles it is meant for (128 x 192 promoted, 128 x 256 with one accumulator and the epilogue
# in 64-column slices, which leaves room for 3 stages), rowwise in the shipped kernel and at
# 128 x 128 (128 x 192 rowwise spills 16 B, so the kernel refuses it).
COMPILED = [
    ("Sm90Config()", False, "m64n128k32.f32.e4m3.e5m2"),
    ("Sm90Config()", True, "m64n128k32.f32.e4m3.e5m2"),
    ("Sm90Config(structure='ws_2wg', tile_m=128, tile_n=192, max_concurrent_steps=3)", False,
     "m64n192k32.f32.e4m3.e5m2"),
    ("Sm90Config(structure='ws_2wg', tile_m=128, tile_n=256, max_concurrent_steps=3, "
     "promote_every=0, epilogue_n=64)", False, "m64n256k32.f32.e4m3.e5m2"),
    ("Sm90Config(structure='ws_2wg', tile_m=128, tile_n=128)", True, "m64n128k32.f32.e4m3.e5m2"),
]


def test_sm90_compiles_for_h100_without_gpu():
    from pallas_kernels import aot

    if not aot.plugin_available():
        pytest.skip("CUDA plugin not installed (`bash scripts/dev.sh cuda-plugin` installs it into .venv/cuda-plugin)")
    script = textwrap.dedent("""
        import glob, os, sys, tempfile
        dump = tempfile.mkdtemp()
        # Read by Mosaic GPU when it compiles: ptxas's register and spill report per kernel.
        os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=dump)
        import jax, jax.numpy as jnp
        from pallas_kernels import aot
        from pallas_kernels.fp8 import Sm90Config
        from pallas_kernels.fp8.matmul_sm90 import fp8_matmul_sm90
        S = jax.ShapeDtypeStruct
        config, rowwise, wgmma = eval(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
        m, n, k = 768, 768, 1024
        scales = (S((m,), jnp.float32), S((n,), jnp.float32)) if rowwise else (
            S((), jnp.float32),) * 2
        def f(a, sa, bt, sb):
            return fp8_matmul_sm90(a, sa, bt, sb, jnp.bfloat16, config=config)
        c = aot.compile_for("h100", f, S((m, k), jnp.float8_e4m3fn), scales[0],
                            S((n, k), jnp.float8_e5m2), scales[1])
        txt = c.as_text()
        assert 'custom_call_target="mosaic_gpu' in txt, "no Mosaic GPU kernel in the HLO"
        assert "wgmma.mma_async.sync.aligned." + wgmma in txt, "no FP8 wgmma " + wgmma
        reports = [open(p).read() for p in glob.glob(os.path.join(dump, "*.ptxas"))]
        assert reports, "no ptxas report written"
        assert all(" 0 bytes spill stores, 0 bytes spill loads" in r for r in reports), reports
        # C7510-C7515: ptxas serialized the wgmmas (the kernel would run at a fraction of peak).
        assert not any("are serialized" in r for r in reports), reports
        print("OK")
    """)
    for config, rowwise, wgmma in COMPILED:
        r = aot.run_script(script, config, str(int(rowwise)), wgmma)
        assert r.returncode == 0 and "OK" in r.stdout, (config, rowwise, r.stderr[-3000:])
