"""Gradient accumulation in place (models/accumulate.py): the running sum is an input of each
microbatch's backward pass, the layers add their weight gradients into it one layer at a time.
It gives the plain sum's gradients, on a sharded mesh and with fp8_delayed's histories, and its
compiled step holds one float32 gradient buffer whatever grad_accum is."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels import aot
from tests.helpers.small import small_config
from titanax.config import apply_overrides
from titanax.models import accumulate
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import model_context
from titanax.plan.cluster import Cluster
from titanax.plan.compile import compile_all_in_subprocess
from titanax.train import step as train_step
from titanax.train.optim import make_optimizer
from titanax.train.resolved import resolve
from titanax.train.run_log import describe_accumulation
from titanax.train.state import create_train_state

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

BASE = {"execution.dtype": "float32", "execution.remat": "full", "train.grad_accum": 4}


def _grads(cfg, n_devices, trace_only=False):
    """(mean loss, gradients, new fp8 state) of one batch through step._grads, jitted (or only
    traced: their shapes)."""
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:n_devices])
    graphdef, state, _ = create_train_state(cfg, mesh, make_optimizer(cfg))
    rng = np.random.default_rng(0)
    B, S = cfg.train.batch_size, cfg.train.seq_len
    toks = rng.integers(0, cfg.model.vocab_size, (B, S + 1)).astype(np.int32)
    batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
             "segment_ids": np.ones((B, S), np.int32),
             "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))}
    loss_fn = train_step.make_loss_fn(cfg, graphdef, resolve(cfg).spec, with_metrics=True)
    fn = lambda p, f, b: train_step._grads(cfg, loss_fn, p, f, b)[:3]  # noqa: E731
    with model_context(mesh):
        return (jax.eval_shape if trace_only else jax.jit(fn))(
            *((fn,) if trace_only else ()), state.weights,
            {} if state.statistics is None else state.statistics, batch)


@pytest.mark.parametrize("extra, n_devices", [
    ({"mesh.fsdp": 2, "mesh.tensor": 2}, 4),  # gradients reduce-scattered into sharded sums
    ({"execution.matmul_precision": "fp8_delayed", "execution.fp8_amax_history": 4}, 1),
])
def test_in_place_sum_equals_the_plain_sum(extra, n_devices):
    cfg = small_config(**BASE, **extra)
    assert accumulate.unsupported(cfg) is None
    spied = []
    real = accumulate.scan_layers_into

    def spy(*a, **k):
        spied.append(True)
        return real(*a, **k)

    accumulate.scan_layers_into = spy
    try:
        loss, grads, fp8 = _grads(cfg, n_devices)
    finally:
        accumulate.scan_layers_into = real
    assert spied, "the step did not run the layers through scan_layers_into"
    plain = apply_overrides(cfg, {"train.grad_accum_in_place": False})
    assert accumulate.unsupported(plain) == "train.grad_accum_in_place=False"
    loss0, grads0, fp80 = _grads(plain, n_devices)
    # The same float32 additions in the same order (sum + one microbatch's gradient): equal
    # up to XLA's freedom to fuse them differently, far below float32's 1e-6 relative.
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    for (path, g), g0 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads0)):
        g, g0 = np.asarray(g), np.asarray(g0)
        assert np.max(np.abs(g - g0)) <= 1e-6 * np.max(np.abs(g0)), jax.tree_util.keystr(path)
    for h, h0 in zip(jax.tree.leaves(fp8), jax.tree.leaves(fp80)):  # amax histories: max
        np.testing.assert_array_equal(np.asarray(h), np.asarray(h0))
    if extra.get("execution.matmul_precision") == "fp8_delayed":
        assert jax.tree.leaves(fp8) and any(np.any(np.asarray(h) > 0)
                                            for h in jax.tree.leaves(fp8))


def test_layouts_that_keep_the_plain_sum_say_why():
    assert "grad_accum=1" in accumulate.unsupported(small_config(**{**BASE,
                                                                   "train.grad_accum": 1}))
    assert "execution.remat='full'" in accumulate.unsupported(small_config(**{**BASE,
                                                                         "execution.remat": "dots"}))
    piped = small_config(**BASE, **{"mesh.pipeline": 2, "pipeline.microbatches": 2})
    assert "pipeline" in accumulate.unsupported(piped)
    # mesh.pipeline=-1 becomes a pipeline only on the mesh: the step sees it there and sums
    # the plain way (the layers never reach scan_layers_into inside the stages).
    filled = small_config(**BASE, **{"mesh.pipeline": -1, "pipeline.microbatches": 2})
    assert accumulate.unsupported(filled) is None
    _grads(filled, 2, trace_only=True)
    assert "the plain way" in describe_accumulation(filled, pipeline_stages=2)
    # The run log says which way, and why not in place.
    assert "summed in place" in describe_accumulation(small_config(**BASE))
    assert describe_accumulation(piped).endswith(
        "summed the plain way (a fresh gradient buffer per microbatch beside the sum): "
        "pipeline parallelism: the stages run their own backward schedule")
    # The running sum's leaves must be the layers' parameters, or it says what differs.
    slot = accumulate._Slot({"layers": {"w": jnp.zeros((2, 3))}})
    with pytest.raises(ValueError, match="do not match the layers' parameters"):
        accumulate.scan_layers_into(slot, lambda x, s: x,
                                    nnx.State({"w": nnx.Param(jnp.zeros((2, 4)))}),
                                    jnp.zeros(3), ())


@pytest.mark.skipif(not aot.plugin_available(), reason="needs the CUDA plugin "
                    "(bash scripts/dev.sh cuda-plugin)")
def test_compiled_step_holds_one_gradient_sum_whatever_grad_accum():
    """Deviceless B200 compiles, FSDP over 8: the step's temporaries at grad_accum 8 are no
    larger than at 2, and the plain sum's exceed the in-place one's by two float32 copies of
    the sharded layer stack (the zeroed sum and the fresh stack)."""
    # Weights large against the activations (a 64-token sequence per device), so that the
    # gradient copies stand out of XLA's other temporaries (the gathered bf16 weights).
    d, L, F, V = 1024, 4, 4096, 1024
    cfg = {"model.d_model": d, "model.n_layers": L, "model.n_heads": 8, "model.n_kv_heads": 8,
           "model.ffn_dim": F, "model.vocab_size": V, "model.max_seq_len": 64,
           "execution.dtype": "bfloat16", "execution.remat": "full", "execution.attention_impl": "cudnn",
           "train.batch_size": 64, "train.seq_len": 64, "mesh.data": 1, "mesh.fsdp": 8}
    runs = {"2": {"train.grad_accum": 2}, "8": {"train.grad_accum": 8},
            "8 plain": {"train.grad_accum": 8, "train.grad_accum_in_place": False}}
    results = compile_all_in_subprocess([small_config(**cfg, **extra) for extra in runs.values()],
                                        Cluster("b200", 1), timeout_s=300)
    temps = {}
    for name, r in zip(runs, results):
        assert r["ok"] and r["target"] == "gpu", r
        temps[name] = r["memory"]["temporaries"]
    layers = L * (4 * d * d + 3 * d * F) * 4 // 8  # float32 matrices, sharded 8 ways
    # (measured: 202, 186 and 281 MB against 34 MB of layer gradients)
    assert temps["8"] <= temps["2"], temps
    assert temps["8 plain"] - temps["8"] >= 2 * layers, (temps, layers)
