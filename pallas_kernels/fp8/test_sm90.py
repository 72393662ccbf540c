"""Hopper wgmma kernel: run under the Mosaic GPU interpreter on CPU (small shapes), and compiled
for an H100 without a GPU (deviceless, through titanax.perf.aot and the CUDA plugin)."""

import textwrap

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.fp8 import Sm90Config, fp8_matmul, quantize_tensorwise
from pallas_kernels.fp8.config import E4M3, E5M2
from pallas_kernels.fp8.reference import fp8_matmul_reference

CFG = Sm90Config(tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=2)


def test_sm90_interpret_exact_and_mixed_formats():
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.randint(ka, (128, 256), -8, 9).astype(jnp.float32).astype(E4M3)
    b = jax.random.randint(kb, (256, 64), -8, 9).astype(jnp.float32).astype(E5M2)
    out = fp8_matmul(a, jnp.float32(0.5), b, jnp.float32(4.0), jnp.float32, impl="sm90",
                     config=CFG, interpret=plgpu.InterpretGPUParams())
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
        Sm90Config(tile_m=256, tile_n=256, tile_k=256, max_concurrent_steps=4)


def test_sm90_compiles_for_h100_without_gpu():
    from titanax.perf import aot

    if not aot.plugin_available():
        pytest.skip("CUDA plugin not installed (scripts/dev.sh installs it into .venv/cuda-plugin)")
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp
        from titanax.perf import aot
        from pallas_kernels.fp8 import fp8_matmul
        S = jax.ShapeDtypeStruct
        def f(a, sa, b, sb):
            return fp8_matmul(a, sa, b, sb, jnp.bfloat16, impl="sm90")
        c = aot.compile_for("h100", f, S((256, 1024), jnp.float8_e4m3fn), S((), jnp.float32),
                            S((1024, 512), jnp.float8_e5m2), S((), jnp.float32))
        txt = c.as_text()
        assert 'custom_call_target="mosaic_gpu' in txt, "no Mosaic GPU kernel in the HLO"
        assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e5m2" in txt, "no FP8 wgmma"
        print("OK")
    """)
    r = aot.run_script(script)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
