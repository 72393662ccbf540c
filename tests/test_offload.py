"""Host offload (train/offload.py): train.offload_optimizer, train.offload_params and
execution.remat=full_offload train exactly as without them, keep their leaves in pinned host memory
between steps, checkpoint and restore there, and (deviceless H100 compile) move bytes from HBM
to host memory."""


import jax
import numpy as np
import optax
import pytest

from pallas_kernels import aot
from tests.helpers.small import ROOT
from titanax.config import ConfigError, apply_overrides, load_config
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import model_context
from titanax.plan.cluster import Cluster
from titanax.plan.compile import compile_all_in_subprocess
from titanax.train import offload
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.state import TrainState, abstract_train_state, create_train_state, jit_train_step

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

TINY = {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.ffn_dim": 128, "model.vocab_size": 256, "execution.dtype": "float32",
        "execution.remat": "full", "train.batch_size": 8, "train.seq_len": 32, "mesh.data": 1,
        "optim.warmup_steps": 1,
        # AdamW's early steps move each weight by about lr x sign(gradient): a gradient at
        # rounding-noise level, which two programs (offloaded or not) may round to either
        # sign, would move a weight by 2 lr. An eps well above that noise makes the update
        # continuous in the gradient (at most lr / eps x its difference), so the comparison
        # of the trained states holds on any CPU.
        "optim.eps": 1e-3}
OPT = {"train.offload_optimizer": True}
PARAMS = {"train.offload_params": True}
BOTH = {**OPT, **PARAMS}
STEPS = 3


def tiny(**extra):
    return apply_overrides(load_config(ROOT / "configs" / "tiny.py"), {**TINY, **extra})


def _batches(cfg, n):
    rng = np.random.default_rng(0)
    B, S = cfg.train.batch_size, cfg.train.seq_len
    for _ in range(n):
        toks = rng.integers(0, cfg.model.vocab_size, (B, S + 1)).astype(np.int32)
        yield {"inputs": toks[:, :-1], "targets": toks[:, 1:],
               "segment_ids": np.ones((B, S), np.int32),
               "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))}


def _train(cfg, n_devices=1):
    """(losses of STEPS steps, final state), the step jitted as train/loop.py jits it."""
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:n_devices])
    tx = make_optimizer(cfg)
    graphdef, state, shardings = create_train_state(cfg, mesh, tx)
    step = jit_train_step(cfg, mesh, graphdef, shardings, tx, lr_schedule(cfg))
    losses = []
    with model_context(mesh):
        for batch in _batches(cfg, STEPS):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return losses, state


def _kinds(state, part):
    """{'layers' or 'other': {memory kinds}} for the params (part='params') or the Adam
    moments (part='moments') of a train state."""
    out = {}
    if part == "params":
        leaves = jax.tree_util.tree_leaves_with_path(state.weights)
    else:
        adam = state.opt_state[-1][0]
        leaves = jax.tree_util.tree_leaves_with_path({"mu": adam.mu, "nu": adam.nu})
    for path, x in leaves:
        key = "layers" if offload.is_layer_path(path) else "other"
        out.setdefault(key, set()).add(x.sharding.memory_kind)
    return out


def _assert_same(losses, state, ref_losses, ref_state):
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def reference():
    return _train(tiny())


@pytest.mark.parametrize("extra", [OPT, PARAMS, {"execution.remat": "full_offload"}],
                         ids=["optimizer", "params", "full_offload"])
def test_offload_trains_as_without(reference, extra):
    losses, state = _train(tiny(**extra))
    _assert_same(losses, state, *reference)
    moments, params = _kinds(state, "moments"), _kinds(state, "params")
    host, device = {"pinned_host"}, {"device"}
    assert moments == ({"layers": host, "other": host} if extra.get("train.offload_optimizer")
                       else {"layers": device, "other": device})
    assert params == ({"layers": host, "other": device} if extra.get("train.offload_params")
                      else {"layers": device, "other": device})
    assert state.opt_state[-1][0].count.sharding.memory_kind == "device"


def test_fsdp_over_8_devices_with_both_offloads_and_accumulation():
    """Both offloads together on 8 devices, mesh data 4 x fsdp 2, two microbatches a step:
    the host-resident layers' gradients are summed in place on the device
    (models/accumulate.py brings each layer's weights over for its backward)."""
    layout = {"mesh.data": 4, "mesh.fsdp": 2, "train.batch_size": 16, "train.grad_accum": 2}
    ref = _train(tiny(**layout), 8)
    losses, state = _train(tiny(**layout, **BOTH), 8)
    _assert_same(losses, state, *ref)
    w = state.weights["layers"]["wq"].get_value()
    # 'embed' is split over fsdp x context (parallel/rules.py); context is 1 here
    assert w.sharding.memory_kind == "pinned_host" and "fsdp" in w.sharding.spec[1]


def _random_like(tree, key, scale=1.0):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [scale * jax.random.normal(k, x.shape, x.dtype)
                                        for k, x in zip(keys, leaves)])


PIPELINE = {"mesh.data": 2, "mesh.fsdp": 2, "mesh.pipeline": 2, "model.n_layers": 4,
            "pipeline.microbatches": 2, "pipeline.schedule": "circular"}


@pytest.mark.parametrize("clip_norm, finite, layout", [
    (1.0, True, {}), (1e6, False, {}), (1.0, True, {**PIPELINE, "train.offload_params": False})],
    ids=["clipped", "non-finite", "pipeline"])
def test_streamed_update_is_optax_update(clip_norm, finite, layout):
    """The update alone against optax's, on an fp8_delayed state (its amax histories apart,
    in device memory) with moments and layer weights in host memory: the clip triggered or not,
    a non-finite step; and on a pipeline layout (mesh.pipeline=2, the stack stored stage-major
    by the circular schedule: offload_optimizer only), where each stage scans its own layers
    and nothing is gathered."""
    cfg = tiny(**{**BOTH, "execution.matmul_precision": "fp8_delayed",
                  "optim.clip_norm": clip_norm, **layout})
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:8 if layout else 1])
    tx = make_optimizer(cfg)
    _, state, shardings = create_train_state(cfg, mesh, tx)
    params, opt_state = state.weights, state.opt_state
    # A few steps' worth of non-zero moments and a step count past 1.
    adam = opt_state[-1][0]
    adam = adam._replace(mu=_random_like(adam.mu, jax.random.key(1), 0.01),
                         nu=jax.tree.map(abs, _random_like(adam.nu, jax.random.key(2), 1e-4)),
                         count=adam.count + 5)
    opt_state = (opt_state[0], (adam, *opt_state[-1][1:]))
    opt_state = jax.device_put(opt_state, shardings.opt_state)
    raw = _random_like(params, jax.random.key(3), 0.1)
    assert "fp8_wq" not in params["layers"]  # the histories: state.statistics, on the device
    assert state.statistics["layers"]["fp8_wq"].get_value().sharding.memory_kind == "device"

    def reference(params, opt_state, grads):
        updates, new_state = tx.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        keep = lambda n, o: jax.numpy.where(finite, n, o)
        return jax.tree.map(keep, new, params), jax.tree.map(keep, new_state, opt_state)

    def streamed(params, opt_state, grads):
        norm = offload.global_norm(grads)
        return offload.streamed_update(cfg, tx, grads, opt_state, params, norm,
                                       jax.numpy.asarray(finite))

    host_params = shardings.weights
    with model_context(mesh):
        want = jax.jit(reference)(*jax.device_get((params, opt_state, raw)))
        raw = jax.device_put(raw, jax.tree.map(lambda s: s.with_memory_kind("device"),
                                               host_params))
        compiled = jax.jit(streamed, out_shardings=(host_params, shardings.opt_state)).lower(
            params, opt_state, raw).compile()
        got = compiled(params, opt_state, raw)
    assert "all-gather" not in compiled.as_text()
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)
    weights = got[0]["layers"]["wq"].get_value()
    assert weights.sharding.memory_kind == ("device" if layout else "pinned_host")
    assert got[1][-1][0].mu["layers"]["wq"].get_value().sharding.memory_kind == "pinned_host"


def test_checkpoints_restore_into_host_memory_either_way(tmp_path):
    """train() with both offloads (training, evaluating and saving with host-resident leaves)
    writes checkpoints that restore with those leaves in pinned host memory, and into a run
    without offload (the same pytree and values)."""
    from titanax.checkpoint.manager import Checkpointer
    from titanax.train.loop import train

    cfg = tiny(**BOTH, **{"train.steps": 4, "checkpoint.every_steps": 2,
                          "train.progress_bar": False, "train.log_every": 1,
                          "train.eval_every": 0, "train.eval_batches": 1,
                          "data.source": "synthetic"})
    result = train(cfg, tmp_path, log=lambda *_: None, devices=jax.devices()[:1])
    assert result.final_step == 4 and all(np.isfinite(list(result.losses.values())))
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    ckpt = Checkpointer(tmp_path / "checkpoints", cfg.checkpoint, read_only=True)
    assert ckpt.all_steps() == [2, 4]
    restored = {}
    for name, c in (("offload", cfg), ("plain", tiny(**{"train.steps": 4}))):
        _, abstract, _ = abstract_train_state(c, mesh, make_optimizer(c))
        with model_context(mesh):
            restored[name] = TrainState.from_saved(ckpt.restore(4, abstract.to_saved())[0])
    ckpt.close()
    assert _kinds(restored["offload"], "moments") == {"layers": {"pinned_host"},
                                                      "other": {"pinned_host"}}
    assert _kinds(restored["offload"], "params") == {"layers": {"pinned_host"},
                                                     "other": {"device"}}
    assert _kinds(restored["plain"], "moments") == {"layers": {"device"}, "other": {"device"}}
    assert int(restored["offload"].step) == 4
    for a, b in zip(jax.tree.leaves(restored["offload"]), jax.tree.leaves(restored["plain"]),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_errors_name_the_fix():
    with pytest.raises(ConfigError, match="train.offload_params.*execution.remat=full"):
        tiny(**PARAMS, **{"execution.remat": "none"})
    with pytest.raises(ConfigError, match="train.offload_params.*execution.remat=full or "
                       "full_offload.*train.grad_accum=1"):
        tiny(**PARAMS, **{"train.grad_accum": 2, "execution.remat": "dots"})
    with pytest.raises(ConfigError, match="train.offload_params.*grad_accum_in_place=true"):
        tiny(**PARAMS, **{"train.grad_accum": 2, "train.grad_accum_in_place": False})
    tiny(**PARAMS, **{"train.grad_accum": "auto"})  # summed in place
    with pytest.raises(ConfigError, match="train.offload_params.*mesh.pipeline=1"):
        tiny(**PARAMS, **{"mesh.pipeline": 2, "model.n_layers": 4, "mesh.data": 1})
    tiny(**OPT, **{"mesh.pipeline": 2, "model.n_layers": 4, "train.grad_accum": 2,
                   "execution.remat": "none"})  # the optimizer offload alone has no such limits




@pytest.mark.skipif(not aot.plugin_available(), reason="needs the CUDA plugin "
                    "(bash scripts/dev.sh cuda-plugin)")
def test_deviceless_h100_compile_moves_state_and_activations_to_host():
    """Both offloads and full_offload, 8 H100s, FSDP: the layers' weights and all moments are
    host arguments updated in place, their gradients and the saved layer inputs host
    temporaries, and the device holds only the rest of the state."""
    d, L, F, V, B, S = 512, 4, 2048, 4096, 8, 1024
    cfg = {"model.d_model": d, "model.n_layers": L, "model.n_heads": 8, "model.n_kv_heads": 8,
           "model.ffn_dim": F, "model.vocab_size": V, "execution.dtype": "bfloat16",
           "execution.remat": "full_offload", "train.batch_size": B, "train.seq_len": S,
           "mesh.data": 1, "mesh.fsdp": 8, **BOTH,
           "execution.attention_impl": "cudnn"}  # (XLA's attention compiles 3x slower here)
    plain = {**cfg, "execution.remat": "full", "train.offload_optimizer": False,
             "train.offload_params": False}
    mem = {}
    results = compile_all_in_subprocess([tiny(**plain), tiny(**cfg)], Cluster("h100", 1),
                                        timeout_s=240)
    for name, result in zip(("plain", "offload"), results):
        assert result["ok"] and result["target"] == "gpu", result
        mem[name] = result["memory"]
    m = mem["offload"]
    # float32 bytes per device of the stacked layers (matrices sharded 8 ways, norm scales
    # replicated) and of the rest (embedding and output layer sharded, final norm replicated)
    layers = L * (4 * d * d + 3 * d * F) * 4 // 8 + L * 2 * d * 4
    rest = 2 * V * d * 4 // 8 + d * 4
    # Weights of the layers, all moments: host arguments, updated in place.
    assert m["host_arguments"] == 3 * layers + 2 * rest
    assert m["host_aliased"] == m["host_arguments"]
    # Host temporaries: the layers' gradients and the saved layer inputs (L x B/8 x S x d bf16).
    assert m["host_temporaries"] == layers + L * (B // 8) * S * d * 2
    # The device keeps the rest of the weights (and the batch, the step count)...
    assert rest < m["arguments"] < rest + 4 * B * S * 4 // 8 + 1024
    # ...and its total drops by the state, the gradients and the saved inputs that moved.
    assert mem["plain"]["host_arguments"] == 0
    assert m["total"] <= mem["plain"]["total"] - m["host_arguments"] - layers


def test_hf_import_into_host_resident_layers(tmp_path):
    """import_hf writes each HF layer into the stacked weights; with train.offload_params that
    stack lives in pinned host memory and the import still lands every tensor there."""
    from titanax.checkpoint.manager import Checkpointer
    from titanax.generate import load_for_inference
    from titanax.hf.exporter import export_hf
    from titanax.hf.importer import import_hf

    cfg = tiny()
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    _, state, _ = create_train_state(cfg, mesh, make_optimizer(cfg))
    ckpt = Checkpointer(tmp_path / "src" / "checkpoints", cfg.checkpoint)
    ckpt.save(0, state.to_saved(), data_state=None, config=cfg.to_dict())
    ckpt.close()
    export_hf(tmp_path / "src", tmp_path / "hf", dtype="float32", progress=False)
    import_hf(tmp_path / "hf", tiny(**PARAMS), tmp_path / "dst", devices=jax.devices()[:1],
              progress=False, log=lambda *_: None)
    _, _, params, _ = load_for_inference(tmp_path / "dst")  # sampling: offload turned off
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.weights)):
        assert a.sharding.memory_kind != "pinned_host"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
