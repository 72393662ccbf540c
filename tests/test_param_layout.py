"""wo and w_down stored embed-first ([L, d, Hq, hd], [L, d, F], as HF stores them), computed by
ops.linear's 'AK,BK->AB' form; checkpoints written in the old layout ([L, Hq, hd, d],
[L, F, d], no recorded layout) still resume, restore onto other meshes, export and generate."""

import filecmp
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers.small import run_small, small_config, tree_equal
from titanax import ops
from titanax.checkpoint.manager import Checkpointer
from titanax.checkpoint.migrations import legacy_params
from titanax.checkpoint.reader import CheckpointReader
from titanax.config import apply_overrides
from titanax.generate import load_for_inference
from titanax.hf.exporter import export_hf
from titanax.models.llama3.migrations import LEGACY_TRANSPOSES
from titanax.models.llama3.model import Llama
from titanax.parallel.mesh import build_mesh, single_device_mesh
from titanax.parallel.rules import model_context
from titanax.train.optim import make_optimizer
from titanax.train.state import TrainState, abstract_train_state, create_train_state

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

# --- ops.linear with the weight's contracted axes last -------------------------------------------

@pytest.mark.parametrize("spec, x_shape, w_shape", [
    ("bshk,dhk->bsd", (2, 3, 4, 8), (16, 4, 8)),  # wo
    ("bsf,df->bsd", (2, 3, 24), (16, 24)),  # w_down
])
@pytest.mark.parametrize("precision", ["default", "highest"])
def test_linear_with_w_contracted_last_matches_einsum(spec, x_shape, w_shape, precision):
    x = jax.random.normal(jax.random.key(0), x_shape)
    w = jax.random.normal(jax.random.key(1), w_shape)
    f = lambda x, w: ops.linear(x, w, spec, precision=precision, dtype=jnp.float32)  # noqa: E731
    ref = lambda x, w: jnp.einsum(spec, x, w, precision=jax.lax.Precision.HIGHEST)  # noqa: E731
    np.testing.assert_allclose(f(x, w), ref(x, w), rtol=1e-5, atol=1e-5)
    loss = lambda fn: lambda x, w: jnp.sum(jnp.sin(fn(x, w)))  # noqa: E731
    for got, want in zip(jax.grad(loss(f), (0, 1))(x, w), jax.grad(loss(ref), (0, 1))(x, w)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["fp8_tensorwise", "mxfp8"])
def test_fp8_linear_with_w_contracted_last_is_the_transposed_weight(precision):
    """The FP8 path passes fp8_linear the weight's [K, N] transpose: the same numbers (values
    and gradients) as the same weight stored [K, N]."""
    x = jax.random.normal(jax.random.key(0), (2, 4, 64))
    w_NK = jax.random.normal(jax.random.key(1), (32, 64))
    last = lambda x, w: ops.linear(x, w, "bsf,df->bsd", precision=precision,  # noqa: E731
                                   dtype=jnp.float32)
    first = lambda x, w: ops.linear(x, w.T, "bsf,fd->bsd", precision=precision,  # noqa: E731
                                    dtype=jnp.float32)
    np.testing.assert_array_equal(last(x, w_NK), first(x, w_NK))
    g = lambda fn: jax.grad(lambda x, w: jnp.sum(fn(x, w) ** 2), (0, 1))(x, w_NK)  # noqa: E731
    for a, b in zip(g(last), g(first)):
        np.testing.assert_array_equal(a, b)


def test_linear_rejects_other_specs():
    x, w = jnp.ones((2, 3, 16)), jnp.ones((4, 16, 8))
    for spec in ("bsd,udv->bsuv",  # contracted axis in the middle of w
                 "bsd,dv->bvs",  # output not x's kept axes then w's
                 "bhk,khd->bd"):  # contracted axes in another order in w than in x
        with pytest.raises(ValueError, match="AK,BK->AB"):
            ops.linear(x, w, spec, dtype=jnp.float32)


def test_wo_and_w_down_are_stored_embed_first():
    run = small_config()
    cfg = run.model
    with model_context(single_device_mesh()):
        model = Llama(cfg, run.execution, rngs=nnx.Rngs(0))
    L, d, F, H, hd = cfg.n_layers, cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.resolved_head_dim
    assert model.layers.wo.kernel.shape == (L, d, H, hd)
    assert model.layers.wo.kernel.get_metadata()["out_sharding"] == ("layers", "embed", "heads",
                                                              "head_dim")
    assert model.layers.w_down.kernel.shape == (L, d, F)
    assert model.layers.w_down.kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
    # out_std = init_std / sqrt(2 L), as before
    want = run.execution.init_std / np.sqrt(2 * L)
    for w in (model.layers.wo.kernel, model.layers.w_down.kernel):
        assert abs(float(jnp.std(w[...])) / want - 1) < 0.05


# --- checkpoints in the old layout ------------------------------------------------------------

def _old_layout(state):
    """state with every wo / w_down leaf (weights and Adam moments) in the pre-change layout."""
    def to_old(keypath, x):
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))))
                for k in keypath]
        keys = [k for k in keys if k != "value"]
        if len(keys) >= 2 and keys[-2] == "layers" and keys[-1] in LEGACY_TRANSPOSES:
            return jnp.transpose(x, np.argsort(LEGACY_TRANSPOSES[keys[-1]]))
        return x
    return jax.tree_util.tree_map_with_path(to_old, state)


def _save_as_before(monkeypatch, directory, step, state, cfg, config: dict, **items):
    """Saves with today's Checkpointer as the code before the change did: no recorded layout."""
    ckpt = Checkpointer(directory, cfg.checkpoint)
    real = ckpt.manager.save
    monkeypatch.setattr(ckpt.manager, "save",
                        lambda step, **kw: real(step, **{**kw, "custom_metadata": None}))
    ckpt.save(step, state, data_state=items.get("data_state"), config=config,
              run_state=items.get("run_state"))
    ckpt.close()


def test_legacy_detection_uses_the_recorded_layout_and_the_configs_shapes():
    cfg = small_config(**{"model.ffn_dim": 128}).model  # F == d: both w_down shapes agree
    L, d, H, hd = cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.resolved_head_dim
    old = {"wo": (L, H, hd, d), "w_down": (L, d, d)}
    new = {"wo": (L, d, H, hd), "w_down": (L, d, d)}
    assert legacy_params(cfg, old, None) == LEGACY_TRANSPOSES  # no record: written before
    assert legacy_params(cfg, new, 2) == {}  # recorded: the current layout, same shapes
    assert legacy_params(cfg, new, None) == {"w_down": (0, 2, 1)}  # wo's shape says current


@pytest.mark.parametrize("ffn_dim", [384, 128])  # 128 == d_model: only the record tells
def test_old_layout_checkpoint_restores_resharded(tmp_path, monkeypatch, ffn_dim):
    save_cfg = small_config(**{"mesh.fsdp": 8, "model.ffn_dim": ffn_dim,
                               "checkpoint.async_save": False})
    tx = make_optimizer(save_cfg)
    _, state, _ = create_train_state(save_cfg, build_mesh(save_cfg.mesh, jax.devices()), tx)
    _save_as_before(monkeypatch, tmp_path / "old", 5, _old_layout(state.to_saved()), save_cfg,
                    save_cfg.to_dict())
    ckpt = Checkpointer(tmp_path / "new", save_cfg.checkpoint)
    ckpt.save(5, state.to_saved(), data_state=None, config=save_cfg.to_dict())
    ckpt.close()

    cfg = apply_overrides(save_cfg, {"mesh.fsdp": 2, "mesh.data": 2, "mesh.tensor": 2})
    mesh = build_mesh(cfg.mesh, jax.devices())
    _, abstract, shardings = abstract_train_state(cfg, mesh, make_optimizer(cfg))
    for folder in ("old", "new"):
        source = Checkpointer(tmp_path / folder, cfg.checkpoint, read_only=True)
        assert source.param_layout(5) == (None if folder == "old" else 2)
        with model_context(mesh):
            got = source.restore_latest_good(abstract.to_saved(), cfg=cfg)
            restored, _, _ = source.restore(5, abstract.to_saved())  # checkpoint.restore's path
        source.close()
        for tree in map(TrainState.from_saved, (got.state, restored)):
            assert tree_equal(tree.weights, state.weights)
            assert tree_equal(tree.opt_state, state.opt_state)  # Adam moments too
            for leaf, want in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
                assert leaf.sharding.spec == want.spec and leaf.sharding.mesh.shape == mesh.shape

        reader = CheckpointReader(tmp_path / folder)
        layers = state.weights["layers"]
        for name in ("wo", "w_down"):
            want = np.asarray(layers[name][...])
            assert reader.params()[("layers", name)][0] == want.shape
            np.testing.assert_array_equal(reader.read(("layers", name)), want)
            np.testing.assert_array_equal(reader.read(("layers", name), slice(1, 2)), want[1:2])
            np.testing.assert_array_equal(reader.read(("layers", name), (0, 3)), want[0, 3])


def test_old_layout_run_resumes_exports_and_generates(tmp_path, monkeypatch):
    """One run's step-2 checkpoint, and the same rewritten in the old layout (as the code before
    the change saved it, data position and counters included): resuming either gives the same
    step 3, export the same HF files, generation the same weights."""
    new, old = tmp_path / "new", tmp_path / "old"
    run_small(new, 2)
    shutil.copytree(new, old)
    cfg = small_config()
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    _, abstract, _ = abstract_train_state(cfg, mesh, make_optimizer(cfg))
    with model_context(mesh):
        saved = Checkpointer(new / "checkpoints", cfg.checkpoint, read_only=True)
        r = saved.restore_latest_good(abstract.to_saved())
        saved.close()
    shutil.rmtree(old / "checkpoints")
    _save_as_before(monkeypatch, old / "checkpoints", r.step, _old_layout(r.state), cfg,
                    r.config, data_state=r.data_state, run_state=r.run_state)
    assert Checkpointer(old / "checkpoints", cfg.checkpoint, read_only=True).param_layout(2) is None

    # launch.export_hf reads through checkpoint/reader.py
    export_hf(new, tmp_path / "hf_new", progress=False)
    export_hf(old, tmp_path / "hf_old", progress=False)
    files = sorted(p.name for p in (tmp_path / "hf_new").iterdir())
    assert any(f.endswith(".safetensors") for f in files)
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "hf_new", tmp_path / "hf_old", files,
                                               shallow=False)
    assert not mismatch and not errors, (mismatch, errors)

    # launch.generate
    _, _, p_new, _ = load_for_inference(new)
    _, _, p_old, _ = load_for_inference(old)
    assert tree_equal(p_new, p_old)

    # train resume (the optimizer moments matter from step 3 on)
    a, _ = run_small(new, 3)
    b, log = run_small(old, 3)
    assert "at step 2" in log and list(b.losses) == [3]
    assert a.losses[3] == b.losses[3]
    ck_a = Checkpointer(new / "checkpoints", cfg.checkpoint, read_only=True)
    ck_b = Checkpointer(old / "checkpoints", cfg.checkpoint, read_only=True)
    assert ck_b.param_layout(3) == 2  # saved again in the current layout
    with model_context(mesh):
        sa, _, _ = ck_a.restore(3, abstract.to_saved())
        sb, _, _ = ck_b.restore(3, abstract.to_saved())
    ck_a.close()
    ck_b.close()
    assert tree_equal(sa, sb)
