"""Blackwell block-scaled kernel: the scale layout against the PTX ISA's description, the
wrapper's checks, and a deviceless B200 compile (through pallas_kernels.aot and the CUDA plugin)
that must contain the block-scaled tcgen05 MMA. jax 0.11.2's Mosaic GPU interpreter does not
run block-scaled tcgen05, so the kernel's values are checked on hardware only."""

import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8 import Sm100Config, fp8_matmul
from pallas_kernels.fp8.api import resolve_impl
from pallas_kernels.fp8.config import E4M3, E8M0
from pallas_kernels.fp8.matmul_sm100 import (
    fp8_matmul_sm100,
    from_tcgen05_scale_layout,
    to_tcgen05_scale_layout,
)

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
