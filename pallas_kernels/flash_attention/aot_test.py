"""Deviceless GPU compiles of flash attention, forward and backward, at Llama-3-70B shapes
(64 q heads, 8 kv heads, head_dim 128, causal, bf16): H100 (sm_90a: mosaic_sm90 and triton) and
B200 (sm_100a: mosaic_sm100 and triton); the Mosaic impls' backward must be Mosaic too, in both
its forms (FlashConfig.bwd_fused on and off: Hopper ships it on, Blackwell off). A
Mosaic kernel whose SMEM ring exceeds the chip's 227 KiB must fail to compile. Runs in
subprocesses with the CUDA plugin of .venv/cuda-plugin and JAX_PLATFORMS=cpu
(pallas_kernels.aot), so the rest of the suite never loads CUDA: one per GPU kind, because
Mosaic GPU keeps the first target's architecture for the whole process."""

import json
import subprocess
import sys

import pytest

from pallas_kernels import aot

SCRIPT = r"""
import dataclasses, json, sys, jax, jax.numpy as jnp
from pallas_kernels import aot
from pallas_kernels.flash_attention import FlashConfig, default_config, flash_attention

B, S, Hq, Hkv, D = 1, 8192, 64, 8, 128
q, kv = (jax.ShapeDtypeStruct((B, S, h, D), jnp.bfloat16) for h in (Hq, Hkv))

def fwd_bwd(impl, cfg=None):
    def loss(q, k, v):
        return flash_attention(q, k, v, causal=True, impl=impl, config=cfg).astype(
            jnp.float32).sum()
    return jax.grad(loss, argnums=(0, 1, 2))

res = {}
IMPLS = {"h100": ("mosaic_sm90", "triton"), "b200": ("mosaic_sm100", "triton")}
target = sys.argv[1]
for kind, impl in ((target, impl) for impl in IMPLS[target]):
    text = aot.compile_for(kind, fwd_bwd(impl), q, kv, kv).as_text()
    res[f"{kind}/{impl}"] = "titanax_flash" in text or "__gpu$xla.gpu.triton" in text \
        or "mosaic_gpu" in text
    if impl.startswith("mosaic"):  # forward and backward are Mosaic kernels: no Triton call
        res[f"{kind}/mosaic_bwd"] = "__gpu$xla.gpu.triton" not in text
    if impl == "mosaic_sm100":  # the MMAs are tcgen05 with TMEM accumulators
        res["b200/tcgen05"] = "tcgen05.mma" in text and "tcgen05.ld" in text
    if impl.startswith("mosaic"):  # both backward forms, the shipped one above and the
        # other: FlashConfig.bwd_fused (dQ by TMA reduce-adds, which the interpreter does not
        # run: it gives each CTA a slice of its own; only here) and the dq and dkv kernels
        base = default_config(impl, D)
        res[f"{kind}/fused_default"] = base.bwd_fused
        texts = {base.bwd_fused: text}
        other = dataclasses.replace(base, bwd_fused=not base.bwd_fused)
        texts[other.bwd_fused] = aot.compile_for(kind, fwd_bwd(impl, other), q, kv, kv).as_text()
        res[f"{kind}/fused_reduce_add"] = "cp.reduce.async.bulk.tensor" in texts[True]
        res[f"{kind}/split_no_reduce_add"] = "cp.reduce.async.bulk.tensor" not in texts[False]
        res[f"{kind}/other_mosaic_bwd"] = "__gpu$xla.gpu.triton" not in texts[other.bwd_fused]
# K and V rings of 4 x 256 keys x 128 x bf16 = 512 KiB: over any GPU's shared memory.
too_big = FlashConfig(block_q=64, block_kv=256, max_concurrent_steps=4)
if target == "h100":
    try:
        aot.compile_for("h100", fwd_bwd("mosaic_sm90", too_big), q, kv, kv)
        res["smem_overflow"] = "compiled"
    except Exception as e:
        res["smem_overflow"] = str(e)[:300]
print("RESULT" + json.dumps(res))
"""


@pytest.mark.skipif(not aot.plugin_available(), reason="CUDA plugin not installed in "
                    ".venv/cuda-plugin (bash scripts/dev.sh cuda-plugin installs it)")
def test_deviceless_compile_70b_shapes():
    res = {}
    for target in ("h100", "b200"):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, target], env=aot.cuda_plugin_env(),
                              capture_output=True, text=True, timeout=600, cwd=aot.REPO)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
        assert proc.returncode == 0 and lines, proc.stderr[-3000:]
        res.update(json.loads(lines[-1][len("RESULT"):]))
    assert res["h100/mosaic_sm90"] and res["h100/triton"] and res["b200/triton"], res
    assert res["b200/mosaic_sm100"] and res["b200/tcgen05"], res
    assert res["h100/mosaic_bwd"] and res["b200/mosaic_bwd"], res
    assert res["h100/fused_reduce_add"] and res["b200/fused_reduce_add"], res
    assert res["h100/split_no_reduce_add"] and res["b200/split_no_reduce_add"], res
    assert res["h100/other_mosaic_bwd"] and res["b200/other_mosaic_bwd"], res
    # the shipped backward: fused on Hopper (head_dim 128), the dq and dkv kernels on Blackwell
    assert res["h100/fused_default"] is True and res["b200/fused_default"] is False, res
    assert "exceeds available shared memory" in res["smem_overflow"], res["smem_overflow"]
