"""grouped_matmul: the Mosaic Hopper backend (run in the Mosaic GPU interpreter) against XLA's
ragged_dot in values and both gradients, with an empty group and rows past every group; the
config's and the dispatch's refusals; and a deviceless H100 compile of a Qwen3-30B-A3B-sized
expert GEMM that must hold no dense dot (XLA's own lowering of ragged_dot has one of
[rows, experts x K]).

Tolerance: bf16 operands, float32 accumulation, the Mosaic output rounded once to bf16
(u = 2^-8, so half an ulp is 2^-9 of a value's size); the reference computes in float32 from
the same bf16 operands and its dw is rounded to w's bf16 as well. Two roundings of the largest
entry bound both: 2 x 2^-8 of the largest entry.
"""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import aot
from pallas_kernels.grouped_matmul import GroupedMatmulConfig, grouped_matmul, resolve_impl

TOL = 2 * 2.0 ** -8
M, K, N = 300, 128, 128
SIZES = (100, 0, 60, 96)  # 256 of 300 rows: an empty group, 44 rows in none


def _operands():
    ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(ks[0], (M, K), jnp.float32).astype(jnp.bfloat16)
    w = (0.1 * jax.random.normal(ks[1], (len(SIZES), K, N), jnp.float32)).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (M, N), jnp.float32).astype(jnp.bfloat16)
    return x, w, jnp.asarray(SIZES, jnp.int32), dy


def _value_and_grads(f, x, w, dy):
    def run(x, w):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(dy.astype(y.dtype)))
    return [np.asarray(a, np.float32) for a in jax.jit(run)(x, w)]


@pytest.mark.mosaic_interpret
def test_mosaic_sm90_matches_ragged_dot():
    x, w, sizes, dy = _operands()
    got = _value_and_grads(
        lambda x, w: grouped_matmul(x, w, sizes, impl="mosaic_sm90", interpret=True), x, w, dy)
    want = _value_and_grads(
        lambda x, w: jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes),
        x, w, dy)
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        assert g.shape == r.shape and np.all(np.isfinite(g)), name
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert err < TOL, f"{name}: relative error {err:.2e} >= {TOL:.2e}"
    assert not got[0][sum(SIZES):].any() and not got[1][sum(SIZES):].any()  # rows in no group
    assert not got[2][1].any()  # the empty group's weight gradient


def test_mosaic_sm90_gradients_inside_shard_map(devices8, monkeypatch):
    """Inside a shard_map (the experts' per-device dispatch, models/common/moe_ep.py) on data 2
    x tensor 2: rows split over data, the weight's output width over tensor. The kernels'
    outputs carry no varying axes, so the custom VJP types them itself: dx is summed over
    tensor (x was replicated there), dw over data (w was). Against ragged_dot, whose autodiff
    does that on its own, in the same shard_map.

    The two kernels are replaced by host callbacks computing the same products (their outputs
    too carry no varying axes): the Mosaic GPU interpreter keeps one shared memory for every
    device and asserts at each kernel's end that no barrier is left in it, which another
    device's kernel running at the same time breaks. The kernels' values are checked on one
    device above."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from pallas_kernels.grouped_matmul import api

    def host(fn, shape, *args):
        out = jax.ShapeDtypeStruct(shape, args[0].dtype)
        return jax.pure_callback(lambda *a: np.asarray(fn(*a), out.dtype), out, *args)

    def ragged(x, w, sizes, cfg, interpret, transpose_rhs):
        n = w.shape[1] if transpose_rhs else w.shape[2]
        def np_dot(x, w, sizes):
            w = np.swapaxes(w, 1, 2) if transpose_rhs else w
            ends = np.cumsum(sizes)
            return np.concatenate([x[e - s:e].astype(np.float32) @ w[g].astype(np.float32)
                                   for g, (s, e) in enumerate(zip(sizes, ends))]
                                  + [np.zeros((x.shape[0] - ends[-1], n), np.float32)])
        return host(np_dot, (x.shape[0], n), x, w, sizes)

    def weight_grad(x, dy, sizes, cfg, interpret):
        def np_dw(x, dy, sizes):
            ends = np.cumsum(sizes)
            return np.stack([x[e - s:e].astype(np.float32).T @ dy[e - s:e].astype(np.float32)
                             for s, e in zip(sizes, ends)])
        return host(np_dw, (sizes.shape[0], x.shape[1], dy.shape[1]), x, dy, sizes)

    monkeypatch.setattr(api, "_ragged_dot_kernel", ragged)
    monkeypatch.setattr(api, "_weight_grad", weight_grad)
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    G, Ml = 2, 128
    ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(ks[0], (2 * Ml, K), jnp.float32).astype(jnp.bfloat16)
    w = (0.1 * jax.random.normal(ks[1], (G, K, 2 * N), jnp.float32)).astype(jnp.bfloat16)
    dy = jax.random.normal(ks[2], (2 * Ml, 2 * N), jnp.float32).astype(jnp.bfloat16)
    sizes = jnp.asarray([[70, 40], [0, 128]], jnp.int32)  # each data shard's own groups

    def grads(mm):
        body = lambda x, w, s, dy: jax.vjp(lambda x, w: mm(x, w, s[0]), x, w)[1](dy)  # noqa: E731
        return jax.jit(jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), P(None, None, "tensor"), P("data"),
                                       P("data", "tensor")),
            out_specs=(P("data"), P(None, None, "tensor"))))(x, w, sizes, dy)

    got = grads(lambda x, w, s: grouped_matmul(x, w, s, impl="mosaic_sm90"))
    want = grads(lambda x, w, s: jax.lax.ragged_dot(
        x, w, s, preferred_element_type=jnp.float32).astype(x.dtype))
    for name, g, r in zip(("dx", "dw"), got, want):
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        err = np.max(np.abs(g - r)) / np.max(np.abs(r))
        assert err < TOL, f"{name}: relative error {err:.2e} >= {TOL:.2e}"


def test_config_and_dispatch_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="block_k=32"):
        GroupedMatmulConfig(block_k=32)
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        GroupedMatmulConfig(max_concurrent_steps=1)
    with pytest.raises(ValueError, match="impl 'cutlass'"):
        resolve_impl("cutlass")
    x, w, sizes, _ = _operands()
    with pytest.raises(ValueError, match="16-bit"):
        grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), sizes, impl="mosaic_sm90")
    with pytest.raises(ValueError, match="multiples of 128"):
        grouped_matmul(x[:, :64], w[:, :64], sizes, impl="mosaic_sm90")
    # On a CPU (and for float32 anywhere) auto is XLA's exact ragged_dot.
    assert resolve_impl("auto") == "xla"


SCRIPT = r"""
import json, re, jax, jax.numpy as jnp
from pallas_kernels import aot
from pallas_kernels.grouped_matmul import grouped_matmul
# One layer's expert GEMM of Qwen3-30B-A3B: 8192 tokens x 8 experts each, 128 experts.
rows, D, F, E = 65536, 2048, 768, 128
def step(x, w, sizes, impl):
    y, vjp = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, impl=impl), x, w)
    return y, *vjp(y)
args = (jax.ShapeDtypeStruct((rows, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16), jax.ShapeDtypeStruct((E,), jnp.int32))
res = {}
for impl in ("auto", "xla"):
    c = aot.compile_for("h100", lambda x, w, s, impl=impl: step(x, w, s, impl), *args)
    text = c.as_text()
    res[impl] = {"temp": c.memory_analysis().temp_size_in_bytes,
                 "mosaic": text.count("mosaic_gpu") > 0,
                 "dense": bool(re.search(r"\[65536,262144\]|\[262144,65536\]", text))}
print("RESULT" + json.dumps(res))
"""


@pytest.mark.skipif(not aot.plugin_available(), reason="CUDA plugin not installed in "
                    ".venv/cuda-plugin (bash scripts/dev.sh cuda-plugin installs it)")
def test_deviceless_h100_compile_has_no_dense_dot():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=aot.cuda_plugin_env(),
                          capture_output=True, text=True, timeout=600, cwd=aot.REPO)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    res = json.loads(line[0][len("RESULT"):])
    # XLA's lowering: a dense [rows, experts x D] dot and ~34 GB of temporaries; ours: the
    # Mosaic kernels and no temporaries to speak of.
    assert res["xla"]["dense"] and res["xla"]["temp"] > 10e9, res
    assert res["auto"]["mosaic"] and not res["auto"]["dense"], res
    assert res["auto"]["temp"] < 1e6, res
