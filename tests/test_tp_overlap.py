"""Tensor-parallel communication overlapped with the GEMMs (docs/parallelism.md, "Tensor-parallel
overlap"): the collective matmul (parallel/collective_matmul.py) equals XLA's partitioned
matmul in values and gradients, alone (with and without context parallelism) and through the
train step with execution.tp_overlap=true against one device on simulated CPU devices (with
context 2 too); titanax.config refuses what it cannot do; the HLO reader (perf/hlo_text.py) finds
mesh axes in every replica-group format; the XLA flag names exist in this jaxlib; and the
deviceless H100 compile of the Llama-3-8B-wide step on TP4 x DP2 and TP4 x CP2
(perf/tp_overlap.py, `python -m launch.bench tp_overlap`) shows the sequence-parallel
collectives turned into ring steps beside GEMMs. The compiles need the CUDA plugin
(.venv/cuda-plugin) and skip without it."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import aot
from titanax import xla_flags
from titanax.config import ConfigError
from titanax.ops.linear import linear, linears
from titanax.parallel.collective_matmul import unsupported, use_collective_matmul
from titanax.parallel.rules import MESH_AXES
from titanax.perf import hlo_text, tp_overlap
from titanax.train.resolved import resolve

needs_plugin = pytest.mark.skipif(not aot.plugin_available(), reason="CUDA plugin not installed "
                                  "in .venv/cuda-plugin (bash scripts/dev.sh cuda-plugin installs it)")


def _run_jax_with_flags(flags) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax; jax.numpy.ones(2).block_until_ready()"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_flag_names_exist_in_this_jaxlib():
    """XLA aborts at start-up on an unknown flag (shown by a made-up one) and parses its GPU
    flags on every platform, so a CPU checks GPU_FLAGS and the windowed-einsum flags."""
    ok = _run_jax_with_flags(xla_flags.GPU_FLAGS + xla_flags.WINDOWED_EINSUM_FLAGS)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert _run_jax_with_flags(["--xla_gpu_no_such_flag_for_titanax=true"]).returncode != 0
    assert not set(xla_flags.WINDOWED_EINSUM_FLAGS) & set(xla_flags.GPU_FLAGS)


# --- the HLO reader ----------------------------------------------------------------------------

MESH = {"pipeline": 1, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 4}


def _instr(line: str) -> hlo_text.Instr:
    comps = hlo_text.computations(f"ENTRY %main (p: f32[]) -> f32[] {{\n{line}\n}}\n")
    return comps["main"][0]


@pytest.mark.parametrize("groups, axes", [
    ("replica_groups=[2,4]<=[8]", ("tensor",)),
    ("replica_groups=[4,2]<=[2,4]T(1,0)", ("data",)),
    ("replica_groups={{0,1,2,3},{4,5,6,7}}", ("tensor",)),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("data",)),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ("tensor",)),
    ("replica_groups=mesh['pipeline'=1,'data'=2,'fsdp'=1,'context'=1,'tensor'=4] {'data'}",
     ("data",)),
    ("replica_groups=[1,8]<=[8]", ("data", "tensor")),
])
def test_collective_axes_in_every_replica_group_format(groups, axes):
    ins = _instr(f"  %ag = bf16[4,4096,64]{{2,1,0}} all-gather(%x), channel_id=1, {groups}, "
                 "dimensions={1}, use_global_device_ids=true")
    assert ins.collective == "all-gather"
    assert hlo_text.collective_axes(ins, MESH) == axes
    n = 8 if axes == ("data", "tensor") else 4 if axes == ("tensor",) else 2
    assert hlo_text.wire_bytes(ins) == 4 * 4096 * 64 * 2 * (n - 1) / n


def test_permute_axes_wire_bytes_and_gemm_windows():
    text = """
ENTRY %main (p: bf16[4,1024,64]) -> bf16[4,1024,64] {
  %p = bf16[4,1024,64]{2,1,0} parameter(0)
  %cp = ((bf16[4,1024,64]{2,1,0}), bf16[4,1024,64]{2,1,0}) collective-permute-start(%p), channel_id=2, source_target_pairs={{0,3},{1,0},{2,1},{3,2},{4,7},{5,4},{6,5},{7,6}}
  %g = bf16[4096,64]{1,0} fusion(%p, %p), kind=kCustom, calls=%gemm_fusion_dot.1
  %d = bf16[4,1024,64]{2,1,0} collective-permute-done(%cp)
  %cp2 = ((bf16[4,1024,64]{2,1,0}), bf16[4,1024,64]{2,1,0}) collective-permute-start(%d), channel_id=3, source_target_pairs={{0,4},{4,0}}
  ROOT %d2 = bf16[4,1024,64]{2,1,0} collective-permute-done(%cp2)
}
"""
    comps = hlo_text.computations(text)
    ring, across = comps["main"][1], comps["main"][4]
    assert hlo_text.collective_axes(ring, MESH) == ("tensor",)
    assert hlo_text.collective_axes(across, MESH) == ("data",)
    assert hlo_text.wire_bytes(ring) == 4 * 1024 * 64 * 2
    rows = tp_overlap.tensor_collectives(comps, ["main"], MESH)
    assert rows["collective-permute"]["count"] == 1  # the data-axis one is not counted
    assert rows["collective-permute"]["beside_gemm"] == 1


# --- the collective matmul equals XLA's partitioned matmul ---------------------------------

def _mesh(data=2, tensor=4, pipeline=1, context=1):
    devices = np.array(jax.devices()[:pipeline * data * context * tensor])
    return Mesh(devices.reshape(pipeline, data, 1, 1, context, tensor), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _products(dtype, grad_reduce):
    """q, k (one input, two column-parallel weights sharing a ring) and the row-parallel
    output of an [out, in]-stored weight, with a loss over all three."""
    def fn(x, wq, wk, a, wo):
        q, k = linears(x, [wq, wk], "bsd,dhk->bshk", dtype=dtype, grad_reduce=grad_reduce,
                       tp="column")
        y = linear(a, wo, "bshk,dhk->bsd", dtype=dtype, grad_reduce=grad_reduce, tp="row")
        f32 = lambda t: t.astype(jnp.float32)  # noqa: E731
        return jnp.sin(f32(q)).sum() + jnp.cos(f32(y)).sum() + (f32(k) ** 2).sum(), (q, k, y)
    return fn


@pytest.mark.usefixtures("devices8")
@pytest.mark.parametrize("dtype, grad_reduce, tol, context", [
    (jnp.float32, "compute", 1e-5, 1), (jnp.bfloat16, "float32", 5e-2, 1),
    (jnp.float32, "compute", 1e-5, 2)], ids=["f32", "bf16", "f32_context2"])
def test_collective_matmul_equals_xla_values_and_gradients(dtype, grad_reduce, tol, context):
    """With context 2 the sequence is split over ('context', 'tensor'), the weights over
    'context' as FSDP shards them: one tensor ring per context shard, weight gradients summed
    over both."""
    mesh = _mesh(tensor=4 // context, context=context)
    ks = jax.random.split(jax.random.key(0), 5)
    B, S, D, H, hd = 4, 16, 12, 8, 6
    put = lambda t, spec: jax.device_put(t, NamedSharding(mesh, spec))  # noqa: E731
    seq, embed = (("context", "tensor"), "context") if context > 1 else ("tensor", None)
    args = (put(jax.random.normal(ks[0], (B, S, D)), P("data", seq, None)),
            put(jax.random.normal(ks[1], (D, H, hd)), P(embed, "tensor", None)),
            put(jax.random.normal(ks[2], (D, 4, hd)), P(embed, "tensor", None)),
            put(jax.random.normal(ks[3], (B, S, H, hd)),
                P("data", embed, "tensor", None)),  # the sequence whole per context shard
            put(jax.random.normal(ks[4], (D, H, hd)), P(embed, "tensor", None)))
    results = []
    for on in (False, True):
        with jax.set_mesh(mesh), use_collective_matmul(on):
            fn = jax.jit(jax.grad(_products(dtype, grad_reduce), argnums=range(5), has_aux=True))
            assert ("ppermute" in str(jax.make_jaxpr(fn)(*args))) == on
            results.append(fn(*args))
    for ref, got in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        ref, got = np.asarray(ref, np.float32), np.asarray(got, np.float32)
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * np.abs(ref).max())


# The train step with execution.tp_overlap=true against one device (tests/test_parallel.py's
# loss_and_grads): remat, the layer scan, a gpipe stage and context parallelism's
# load-balanced sequence, split over ('context', 'tensor'), all go through the rings.
OVERLAP_LAYOUTS = {
    "tp4_dp2": {"mesh.data": 2, "mesh.tensor": 4, "model.n_kv_heads": 4},
    "tp2_dp2_pp2": {"mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2,
                    "pipeline.microbatches": 2, "mesh.nvlink_domain": 4},
    "tp2_cp2_fsdp2": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 2, "mesh.tensor": 2},
    "tp2_cp2_pp2": {"mesh.data": 1, "mesh.context": 2, "mesh.tensor": 2, "mesh.pipeline": 2,
                    "pipeline.microbatches": 2, "pipeline.schedule": "gpipe"},
}


@pytest.fixture(scope="module")
def one_device_by_kv_heads():
    """{model.n_kv_heads: (loss, grads)} of the tiny model on one device, computed once each."""
    from tests.helpers.layouts import loss_and_grads, tiny_config

    cache = {}

    def get(n_kv_heads: int):
        if n_kv_heads not in cache:
            cfg = tiny_config(**{"mesh.data": 1, "model.n_kv_heads": n_kv_heads})
            cache[n_kv_heads] = loss_and_grads(cfg, jax.devices()[:1])[:2]
        return cache[n_kv_heads]
    return get


@pytest.mark.usefixtures("devices8")
@pytest.mark.parametrize("name", list(OVERLAP_LAYOUTS))
def test_train_step_with_tp_overlap_matches_one_device(name, one_device_by_kv_heads):
    from tests.helpers.layouts import loss_and_grads, tiny_config

    cfg = tiny_config(**OVERLAP_LAYOUTS[name], **{"execution.tp_overlap": True})
    loss, grads, jaxpr = loss_and_grads(cfg, jax.devices())
    ref_loss, ref_grads = one_device_by_kv_heads(cfg.model.n_kv_heads)
    assert _permute_axes(jaxpr) >= {"('tensor',)"}  # the tensor rings run
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    for path, got, ref in zip(jax.tree_util.tree_leaves_with_path(grads),
                              jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max() + 1e-7,
                                   err_msg=str(path[0]))


@pytest.mark.usefixtures("devices8")
def test_context_shards_each_run_their_own_tensor_ring():
    """Context 2 x tensor 2: the collective matmul's shard_maps are manual over 'context' too,
    its permutes pair devices of one context shard only, and without the flag there are none
    but attention's (the all_gather strategy, so every ppermute left is a ring step)."""
    from tests.helpers.layouts import tiny_config

    over = {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 2, "mesh.tensor": 2,
            "execution.context_strategy": "all_gather"}
    texts = {on: _step_jaxpr(tiny_config(**over, **{"execution.tp_overlap": on}))
             for on in (False, True)}
    assert "ppermute" not in texts[False]
    assert _permute_axes(texts[True]) == {"('tensor',)"}
    assert "manual_axes=frozenset({'context', 'tensor'})" in texts[True]
    assert "P(None, ('context', 'tensor'), None)" in texts[True]  # x split, context major


def _permute_axes(jaxpr: str) -> set[str]:
    return set(re.findall(r"ppermute\[\s*axis_name=(\S*)", jaxpr))


def _step_jaxpr(cfg) -> str:
    from tests.helpers.layouts import make_batch
    from titanax.parallel.mesh import build_mesh
    from titanax.parallel.rules import activation_spec, model_context
    from titanax.train.optim import make_optimizer
    from titanax.train.state import abstract_train_state
    from titanax.train.step import make_loss_fn

    mesh = build_mesh(cfg.mesh, jax.devices())
    graphdef, state, _ = abstract_train_state(cfg, mesh, make_optimizer(cfg))
    batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
        mesh, activation_spec(("batch", "seq")))) for k, v in make_batch(cfg).items()}
    with model_context(mesh):
        loss_fn = make_loss_fn(cfg, graphdef, resolve(cfg).spec)
        return str(jax.make_jaxpr(jax.grad(loss_fn))(state.weights, batch))


def test_not_under_the_1f1b_schedule():
    """1f1b runs a stage's layers under lax.cond: a ring's permutes would run on some stages
    only (on XLA:CPU the loss came out wrong); `unsupported` gives titanax.config's reason."""
    from tests.helpers.layouts import tiny_config

    layout = {"mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2}
    assert unsupported(tiny_config(**layout, **{"pipeline.schedule": "gpipe"})) is None
    reason = unsupported(tiny_config(**layout, **{"pipeline.schedule": "1f1b"}))
    assert reason and "1f1b" in reason


@pytest.mark.parametrize("over, words", [
    ({"mesh.pipeline": 2, "pipeline.schedule": "1f1b", "pipeline.microbatches": 2},
     ["1f1b", "gpipe", "execution.tp_overlap=false"]),
    ({"execution.matmul_precision": "fp8_tensorwise"}, ["FP8", "matmul_precision=default"]),
])
def test_config_refuses_what_the_collective_matmul_cannot_do(over, words):
    from tests.helpers.layouts import tiny_config

    layout = {"mesh.data": 2, "mesh.tensor": 2, **over}
    tiny_config(**layout)  # fine without the overlap
    with pytest.raises(ConfigError, match="execution.tp_overlap") as err:
        tiny_config(**layout, **{"execution.tp_overlap": True})
    for word in words:
        assert word in str(err.value)
    # no tensor ring, nothing to refuse: tp_overlap is then a no-op
    tiny_config(**{**layout, "mesh.data": 4, "mesh.tensor": 1, "execution.tp_overlap": True})


# --- the deviceless H100 compile: the evidence ------------------------------------------------

@pytest.fixture(scope="module")
def h100_tp4():
    # XLA's windowed-einsum flags are measured by `python -m launch.bench tp_overlap` (they
    # change nothing on the tensor axis, docs/parallelism.md); the tests compile the two
    # variants that run.
    return tp_overlap.measure(tp_overlap.StepShape(), ("xla", "collective_matmul"),
                              timeout_s=400)


@needs_plugin
def test_xla_leaves_tensor_parallel_collectives_whole(h100_tp4):
    """Today's flags: the sequence-parallel all-gathers and the row-parallel all-reduces
    (ops/linear flattens [B*S]: XLA all-reduces the whole sequence, then slices) are whole
    collectives, mostly exposed."""
    xla = h100_tp4["xla"]
    assert "error" not in xla, xla
    assert xla["collectives"]["all-gather"]["count"] >= 3 * 2 * 2  # 2 per layer x 3 passes
    assert xla["collectives"]["all-reduce"]["count"] >= 3 * 2 * 2
    assert xla["collectives"]["collective-permute"]["count"] == 0
    assert xla["wire_fraction_beside_gemm"] < 0.5


@needs_plugin
def test_collective_matmul_puts_the_ring_steps_beside_gemms(h100_tp4):
    xla, cm = h100_tp4["xla"], h100_tp4["collective_matmul"]
    assert "error" not in cm, cm
    permutes = cm["collectives"]["collective-permute"]
    # tp - 1 = 3 steps per collective, 4 collectives per layer and pass, 2 layers
    assert permutes["count"] >= 3 * 4 * 2 * 2
    assert permutes["beside_gemm"] >= 0.9 * permutes["count"]
    # what is left is the embedding's and the loss head's (vocab-parallel, not the layers')
    gathers, reduces = (cm["collectives"][k] for k in ("all-gather", "all-reduce"))
    assert gathers["count"] < xla["collectives"]["all-gather"]["count"] / 2
    assert reduces["wire_mb"] < xla["collectives"]["all-reduce"]["wire_mb"] / 4
    assert cm["wire_mb"] < xla["wire_mb"]  # ring reduce-scatters instead of all-reduces
    assert cm["wire_fraction_beside_gemm"] > xla["wire_fraction_beside_gemm"] + 0.4
    assert cm["memory"]["temporaries"] < 1.1 * xla["memory"]["temporaries"]


@needs_plugin
def test_collective_matmul_with_context_parallelism_keeps_rings_per_context_shard():
    """Tensor 4 x context 2: the same ring steps, one ring per context shard; XLA instead
    gathers the layers' sequence over context and tensor together (its bytes, every axis
    counted, are in docs/parallelism.md from `python -m launch.bench tp_overlap --context 2
    --data 1`; the test compiles the collective matmul alone)."""
    result = tp_overlap.measure(tp_overlap.StepShape(context=2, data=1),
                                ("collective_matmul",), timeout_s=400)
    cm = result["collective_matmul"]
    assert "error" not in cm, cm
    permutes = cm["collectives"]["collective-permute"]
    assert permutes["count"] >= 3 * 4 * 2 * 2
    assert permutes["beside_gemm"] >= 0.8 * permutes["count"]
    # the layers' tensor collectives are rings: what is left whole is the embedding's and
    # the loss head's
    assert cm["collectives"]["all-gather"]["count"] <= 6, cm["collectives"]
