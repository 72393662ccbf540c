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
from pallas_kernels.fp8.reference import fp8_matmul_reference

pytestmark = pytest.mark.mosaic_interpret  # warpgroups run in the Mosaic GPU interpreter

CFG = Sm90Config(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2)


# promote_every: 0 (one accumulator), 1 (the default: every K tile), 3 over 4 K tiles (a full
# promotion group, then a partial one left in the accumulator at the end).
@pytest.mark.parametrize("promote_every,k", [(0, 256), (1, 256), (3, 512)])
def test_sm90_interpret_exact_and_mixed_formats(promote_every, k):
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.randint(ka, (128, k), -8, 9).astype(jnp.float32).astype(E4M3)
    b = jax.random.randint(kb, (k, 64), -8, 9).astype(jnp.float32).astype(E5M2)
    cfg = dataclasses.replace(CFG, promote_every=promote_every)
    out = fp8_matmul(a, jnp.float32(0.5), b, jnp.float32(4.0), jnp.float32, impl="sm90",
                     config=cfg, interpret=plgpu.InterpretGPUParams())
    np.testing.assert_array_equal(np.asarray(out), (np.float32(a) @ np.float32(b)) * 2.0)


def test_sm90_interpret_matches_reference_bf16_out():
    kx, kw = jax.random.split(jax.random.key(1))
    (qa, sa) = quantize_tensorwise(jax.random.normal(kx, (64, 256)), E4M3)
    (qb, sb) = quantize_tensorwise(jax.random.normal(kw, (256, 128)) * 0.02, E4M3)
    out = fp8_matmul(qa, sa, qb, sb, jnp.bfloat16, impl="sm90", config=CFG,
                     interpret=plgpu.InterpretGPUParams())
    ref = fp8_matmul_reference(qa, sa, qb, sb, jnp.float32)
    np.testing.assert_allclose(np.float32(out), np.asarray(ref), rtol=8e-3,
                               atol=8e-3 * float(jnp.abs(ref).max()))


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


def test_sm90_compiles_for_h100_without_gpu():
    from pallas_kernels import aot

    if not aot.plugin_available():
        pytest.skip("CUDA plugin not installed (`bash scripts/dev.sh cuda-plugin` installs it into .venv/cuda-plugin)")
    script = textwrap.dedent("""
        import glob, os, tempfile
        dump = tempfile.mkdtemp()
        # Read by Mosaic GPU when it compiles: ptxas's register and spill report per kernel.
        os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=dump)
        import jax, jax.numpy as jnp
        from pallas_kernels import aot
        from pallas_kernels.fp8 import fp8_matmul
        S = jax.ShapeDtypeStruct
        def f(a, sa, b, sb):
            return fp8_matmul(a, sa, b, sb, jnp.bfloat16, impl="sm90")
        c = aot.compile_for("h100", f, S((256, 1024), jnp.float8_e4m3fn), S((), jnp.float32),
                            S((1024, 512), jnp.float8_e5m2), S((), jnp.float32))
        txt = c.as_text()
        assert 'custom_call_target="mosaic_gpu' in txt, "no Mosaic GPU kernel in the HLO"
        assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e5m2" in txt, "no FP8 wgmma"
        reports = [open(p).read() for p in glob.glob(os.path.join(dump, "*.ptxas"))]
        assert reports, "no ptxas report written"
        assert all(" 0 bytes spill stores, 0 bytes spill loads" in r for r in reports), reports
        print("OK")
    """)
    r = aot.run_script(script)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
