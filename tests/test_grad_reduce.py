"""execution.grad_reduce_dtype: weight gradients summed and reduce-scattered in the compute dtype
(default) or in float32."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import aot
from tests.helpers.small import ROOT
from titanax.config import ConfigError, apply_overrides, load_config
from titanax.ops import linear
from titanax.plan.cluster import Cluster, plan_config
from titanax.plan.compile import compile_all_in_subprocess


@pytest.mark.parametrize("spec,w_shape", [("bsd,df->bsf", (64, 48)), ("bsf,df->bsd", (64, 48))])
def test_float32_weight_gradient_is_accumulated_in_float32(spec, w_shape):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    in_dim = w_shape[0] if spec.startswith("bsd") else w_shape[1]
    x = jax.random.normal(k[0], (8, 512, in_dim)).astype(jnp.bfloat16)  # 4096 tokens summed
    w = jax.random.normal(k[1], w_shape) * 0.1
    ct = jax.random.normal(k[2], jax.eval_shape(lambda: linear(x, w, spec)).shape)
    ct = ct.astype(jnp.bfloat16)  # the cotangent arrives in the compute dtype
    # dW depends on x and the cotangent only: their float32 product is the exact sum
    exact = jax.grad(lambda w: jnp.sum(jnp.einsum(spec, x.astype(jnp.float32), w)
                                       * ct.astype(jnp.float32)))(w)
    err = {}
    for mode in ("compute", "float32"):
        y, vjp = jax.vjp(lambda x, w: linear(x, w, spec, grad_reduce=mode), x, w)
        dx, dw = vjp(ct)
        assert dw.dtype == jnp.float32 and dx.dtype == jnp.bfloat16
        err[mode] = float(jnp.max(jnp.abs(dw - exact)) / jnp.max(jnp.abs(exact)))
    assert err["float32"] < 1e-5 < err["compute"]  # bf16 output of the sum vs float32


def test_config_choice():
    cfg = load_config(ROOT / "configs" / "tiny.py")
    assert cfg.execution.grad_reduce_dtype == "compute"
    with pytest.raises(ConfigError, match="execution.grad_reduce_dtype"):
        apply_overrides(cfg, {"execution.grad_reduce_dtype": "fp32"})


@pytest.mark.skipif(not aot.plugin_available(), reason="needs the CUDA plugin "
                    "(bash scripts/dev.sh cuda-plugin)")
def test_fsdp_reduce_scatters_in_the_configured_dtype():
    """Llama 3 8B's preset made small (2 layers of width 1024, 2048-token sequences) on 8
    H100s, FSDP, bf16 compute: the weight gradients' reduce-scatters are bf16 by default and
    float32 with execution.grad_reduce_dtype=float32 (two deviceless compiles in one process)."""
    cluster = Cluster("h100", 1)
    modes = ("compute", "float32")
    small = {"train.batch_size": 8, "model.n_layers": 2, "model.d_model": 1024,
             "model.n_heads": 8, "model.n_kv_heads": 4, "model.ffn_dim": 2048,
             "model.vocab_size": 8192, "train.seq_len": 2048, "train.grad_accum": 1}
    cfgs = [plan_config(load_config(ROOT / "configs" / "llama3_8b.py", {
        **small, "execution.grad_reduce_dtype": mode}), cluster) for mode in modes]
    seen = {}
    for mode, result in zip(modes, compile_all_in_subprocess(cfgs, cluster, timeout_s=300)):
        assert result["ok"] and result["target"] == "gpu", result
        seen[mode] = result["collectives"]["reduce-scatter"]
    assert seen["compute"].get("bf16", 0) > 0
    assert seen["float32"].get("bf16", 0) == 0
    assert seen["float32"].get("f32", 0) > seen["compute"].get("f32", 0)
