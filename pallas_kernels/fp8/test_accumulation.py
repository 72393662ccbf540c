"""What the FP8 GEMMs of fp8_linear become on a GPU, read from deviceless compiles (the CUDA
plugin, pallas_kernels.aot), all in one subprocess: on H100 the forward GEMM may accumulate
fast and dgrad and wgrad must not (accumulation.py); on B200 mxfp8 runs cuDNN's block-scaled
GEMM, never a dequantize-and-dot loop fusion; on H100 mxfp8 is refused in one line.

The step is compiled on a 2-device mesh with the batch sharded, so it goes through the Shardy
partitioner as every FSDP run does (jax 0.11.2's Shardy drops dot algorithms; the operand
precision this code relies on survives it), and with XLA_GPU_FLAGS, as titanax's GPU runs.
"""

import json
import textwrap

import pytest

from pallas_kernels import aot

T, K, N = 512, 384, 128  # tokens (256 per device), in, out: each GEMM has its own output shape
_SCRIPT = textwrap.dedent(f"""
    import json, os, re
    from pallas_kernels.fp8.backends import XLA_GPU_FLAGS
    os.environ["XLA_FLAGS"] = " ".join(XLA_GPU_FLAGS)  # before XLA starts
    import jax, jax.numpy as jnp
    from pallas_kernels import aot
    from pallas_kernels.fp8 import fp8_linear

    P, S = jax.sharding.PartitionSpec, jax.ShapeDtypeStruct

    def compiled(kind, recipe):
        def step(x, w, g):
            y, vjp = jax.vjp(lambda x, w: fp8_linear(x, w, recipe=recipe), x, w)
            return (y, *vjp(g))
        mesh = aot.gpu_mesh(kind, (2,), ("batch",))
        rows = jax.sharding.NamedSharding(mesh, P("batch", None))
        whole = jax.sharding.NamedSharding(mesh, P())
        with jax.set_mesh(mesh):
            return jax.jit(step).lower(S(({T}, {K}), jnp.bfloat16, sharding=rows),
                                       S(({K}, {N}), jnp.float32, sharding=whole),
                                       S(({T}, {N}), jnp.bfloat16, sharding=rows)
                                       ).compile().as_text()

    def calls(hlo):
        out = []
        for line in hlo.splitlines():
            target = re.search(r'custom_call_target="([^"]+)"', line)
            if target and ("cublas" in target[1] or "cudnn" in target[1]):
                shape = re.search(r"= \\(?\\w+\\[([0-9,]+)\\]", line)[1]
                prec = re.search(r'"operand_precision":\\[([^\\]]*)\\]', line)
                out.append([target[1], shape, prec[1] if prec else None])
        return out

    h100 = compiled("h100", "fp8_tensorwise")
    rowwise = compiled("h100", "fp8_rowwise")
    b200 = compiled("b200", "mxfp8")
    try:
        compiled("h100", "mxfp8")
        refusal = None
    except ValueError as e:
        refusal = str(e)
    print("RESULT " + json.dumps({{
        "h100": calls(h100), "b200": calls(b200), "refusal": refusal,
        "h100_triton": "__triton" in h100, "rowwise": calls(rowwise),
        "rowwise_triton": "__triton" in rowwise,
        "b200_dots": len(re.findall(r" dot\\(", b200))}}))
""")


@pytest.fixture(scope="module")
def compiled():
    if not aot.plugin_available():
        pytest.skip("CUDA plugin not installed (`bash scripts/dev.sh cuda-plugin` installs it into .venv/cuda-plugin)")
    r = aot.run_script(_SCRIPT)
    lines = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("recipe", ["h100", "rowwise"], ids=["tensorwise", "rowwise"])
def test_h100_forward_may_accumulate_fast_and_both_backward_gemms_may_not(compiled, recipe):
    """fp8_rowwise's scale vectors multiply the float32 result after the GEMM: the GEMMs are
    the same cuBLASLt FP8 calls as tensorwise's."""
    t = T // 2  # rows per device
    by_shape = {shape: (target, prec) for target, shape, prec in compiled[recipe]}
    f8 = "__cublas$lt$matmul$f8"
    # cuBLASLt's fast accumulation is on exactly when both operand precisions are DEFAULT.
    assert by_shape[f"{t},{N}"] == (f8, '"DEFAULT","DEFAULT"'), compiled[recipe]  # fprop
    assert by_shape[f"{t},{K}"] == (f8, '"HIGHEST","HIGHEST"'), compiled[recipe]  # dgrad
    assert by_shape[f"{K},{N}"] == (f8, '"HIGHEST","HIGHEST"'), compiled[recipe]  # wgrad
    assert len(compiled[recipe]) == 3
    # Triton would ignore the precision (accumulation.py)
    assert not compiled["h100_triton" if recipe == "h100" else "rowwise_triton"]


def test_b200_mxfp8_runs_block_scaled_gemms_not_loop_fused_dots(compiled):
    targets = [target for target, _, _ in compiled["b200"]]
    assert targets == ["__cudnn$blockScaledDot"] * 3, compiled["b200"]
    assert compiled["b200_dots"] == 0  # no dequantized operands multiplied by a plain dot


def test_mxfp8_on_hopper_is_refused_in_one_line(compiled):
    msg = compiled["refusal"]
    assert msg is not None and "\n" not in msg
    assert "Blackwell" in msg and "fp8_tensorwise, fp8_delayed or fp8_rowwise" in msg
    assert "9.0" in msg


def test_a_cudnn_without_block_scaled_gemm_is_refused(monkeypatch):
    """XLA turns MX dots into float32 dequantize-and-dot below cuDNN 9.10: refuse, naming it."""
    import types

    import jax._src.lib

    from pallas_kernels.fp8.reference import check_cudnn_block_scaled_dot

    for version, ok in ((90800, False), (90900, False), (91002, True), (92800, True)):
        fake = types.SimpleNamespace(cudnn_get_version=lambda v=version: v)
        monkeypatch.setattr(jax._src.lib, "cuda_versions", fake)
        if ok:
            check_cudnn_block_scaled_dot()
        else:
            with pytest.raises(ValueError, match=r"cuDNN >= 9.10 .* loaded 9\.[89]:"):
                check_cudnn_block_scaled_dot()
