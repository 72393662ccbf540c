"""Checkpoints and fault tolerance, in process: resharding restore, damaged-checkpoint fallback,
model-config mismatch, checkpoint.restore, permanent steps, non-finite step skipping, signals.
(Kill/resume through the command line: tests/test_resume.py.)"""

import os
import pathlib
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.small import run_small, small_config, tree_equal
from titanax.checkpoint import integrity
from titanax.checkpoint.compare import check_same_model
from titanax.checkpoint.manager import Checkpointer
from titanax.config import CheckpointConfig, ConfigError, apply_overrides
from titanax.parallel.layer_order import reorder_restored
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import model_context
from titanax.preemption import PreemptionWatch
from titanax.train import loop
from titanax.train.metrics import read_metrics
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.state import TrainState, abstract_train_state, create_train_state
from titanax.train.step import make_train_step

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices











def _largest_file(folder: pathlib.Path) -> pathlib.Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_restore_onto_another_mesh_reshards(tmp_path):
    save_cfg = small_config(**{"mesh.data": 1, "mesh.fsdp": 8})
    tx = make_optimizer(save_cfg)
    mesh8 = build_mesh(save_cfg.mesh, jax.devices())
    _, state, _ = create_train_state(save_cfg, mesh8, tx)
    assert state.weights["embed"].get_value().sharding.spec != (None, None)  # really sharded
    ckpt = Checkpointer(tmp_path, save_cfg.checkpoint)  # async, as in training
    ckpt.save(7, state.to_saved(), data_state=None, config=save_cfg.to_dict())
    ckpt.close()
    assert integrity.has_manifest(tmp_path / "7")

    new_cfg = apply_overrides(save_cfg, {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2})
    mesh222 = build_mesh(new_cfg.mesh, jax.devices())
    _, abstract, shardings = abstract_train_state(new_cfg, mesh222, make_optimizer(new_cfg))
    with model_context(mesh222):
        got = Checkpointer(tmp_path, new_cfg.checkpoint).restore_latest_good(
            abstract.to_saved(), cfg=new_cfg)
    restored = TrainState.from_saved(got.state)
    assert got.step == 7 and int(restored.step) == 0
    assert tree_equal(restored.weights, state.weights)
    assert tree_equal(restored.opt_state, state.opt_state)
    for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding.mesh.shape == mesh222.shape and leaf.sharding.spec == want.spec


# Donated buffers whose sharding changes cannot be reused in place; that is expected here.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_circular_pipeline_layer_order_follows_the_new_layout():
    base = {"model.n_layers": 4, "mesh.data": 1}
    circ = small_config(**base, **{"mesh.pipeline": 2, "mesh.fsdp": 4,
                                   "pipeline.schedule": "circular", "pipeline.microbatches": 2})
    flat = small_config(**base, **{"mesh.fsdp": 8})
    _, stored, _ = create_train_state(circ, build_mesh(circ.mesh, jax.devices()),
                                      make_optimizer(circ))
    _, want, shardings = create_train_state(flat, build_mesh(flat.mesh, jax.devices()),
                                            make_optimizer(flat))
    assert not tree_equal(stored.weights["layers"], want.weights["layers"])  # permuted
    got = reorder_restored(stored, shardings, circ, flat)
    assert tree_equal(got, want)  # same seed, same logical weights: now in the same order


def test_damaged_latest_checkpoint_falls_back_and_mismatch_is_refused(tmp_path):
    work = tmp_path / "run"
    first, _ = run_small(work, 4, **{"checkpoint.every_steps": 2, "checkpoint.keep": 2})
    ckpts = work / "checkpoints"
    victim = _largest_file(ckpts / "4")
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated

    result, log = run_small(work, 6, **{"checkpoint.every_steps": 2, "checkpoint.keep": 2})
    assert "is damaged" in log and f"{victim.relative_to(ckpts / '4')} has" in log
    assert "resumed from" in log and "at step 2" in log
    assert (ckpts / "4.corrupt").is_dir()  # moved aside for inspection, not deleted
    # Resumed from step 2, steps 3 and 4 repeat exactly what the first run logged.
    assert result.losses[3] == first.losses[3] and result.losses[4] == first.losses[4]
    rows = [r for r in read_metrics(work) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the repeated steps logged once

    files = lambda: {p.name: p.read_bytes() for p in work.iterdir()  # noqa: E731
                     if p.is_file() and p.name != ".titanax.lock"}  # the lock names its holder
    before = files()
    with pytest.raises(ConfigError) as e:
        run_small(work, 8, **{"model.n_layers": 3, "model.ffn_dim": 256})
    # Refused before it wrote anything: config.json still describes the checkpoints
    # (`launch.train --workdir` continues from it), the tokenizer and metrics are as they were.
    assert files() == before and b'"n_layers": 2' in before["config.json"]
    with pytest.raises(ConfigError, match="nowhere"):  # bad data: refused the same way
        run_small(work, 8, **{"data.source": str(work / "nowhere")})
    assert files() == before
    msg = str(e.value)
    assert "model.n_layers: 2 -> 3" in msg and "model.ffn_dim: 384 -> 256" in msg
    assert "new --workdir" in msg

    # checkpoint.restore: another run's step folder starts a new run from there.
    other, log = run_small(tmp_path / "other", 7, **{"checkpoint.restore": str(ckpts / "6")})
    assert f"resumed from {ckpts}/6 at step 6" in log and list(other.losses) == [7]


# The failed restore of the truncated step leaves an orbax read coroutine unawaited.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_unreadable_checkpoint_without_manifest_falls_back_and_never_all_deleted(tmp_path):
    cfg = CheckpointConfig(async_save=False, keep=3)
    ckpt = Checkpointer(tmp_path, cfg)
    trees = {s: {"step": jnp.asarray(s), "w": jnp.arange(4096.0) * s} for s in (1, 2, 3)}
    for s, tree in trees.items():
        ckpt.save(s, tree, data_state={"pos": s}, config={})
    ckpt.close()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trees[1])
    # Step 3 died between its commit and its manifest, and is truncated: the restore decides.
    for manifest in (tmp_path / "3").glob("titanax_manifest*"):  # merged and per-process parts
        manifest.unlink()
    victim = _largest_file(tmp_path / "3" / "state")
    victim.write_bytes(victim.read_bytes()[:100])
    # Step 2 lost a file after its manifest was written.
    (_largest_file(tmp_path / "2" / "state")).unlink()

    logs = []
    got = Checkpointer(tmp_path, cfg).restore_latest_good(abstract, log=logs.append)
    assert got.step == 1 and got.data_state == {"pos": 1} and tree_equal(got.state, trees[1])
    assert "restoring it failed" in logs[0] and "is missing" in logs[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2.corrupt", "3.corrupt"]

    # When nothing restores, the run stops instead of silently starting from scratch.
    victim = _largest_file(tmp_path / "1" / "state")
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size, other bytes
    with pytest.raises(RuntimeError, match="no checkpoint under .* restores"):
        Checkpointer(tmp_path, cfg).restore_latest_good(abstract, log=logs.append)
    assert "does not match its checksum" in logs[-1] and (tmp_path / "1").is_dir()


def test_checkpoint_without_manifest_is_checked_before_it_is_trusted(tmp_path):
    """A kill -9 between orbax's commit and the manifest leaves a step nobody checksummed: it
    is restored whole and checked for non-finite values before a run trusts it, then
    checksummed; a non-finite one (flipped exponent bits) is set aside for the older step."""
    cfg = CheckpointConfig(async_save=False, keep=3)
    ckpt = Checkpointer(tmp_path, cfg)
    trees = {s: {"step": jnp.asarray(s), "params": {"w": jnp.arange(64.0) * s}}
             for s in (1, 2, 3)}
    trees[3]["params"]["w"] = trees[3]["params"]["w"].at[5].set(jnp.inf)
    for s, tree in trees.items():
        ckpt.save(s, tree, data_state={"pos": s}, config={})
    ckpt.close()
    for s in (2, 3):  # both died before their manifests
        for manifest in (tmp_path / str(s)).glob("titanax_manifest*"):
            manifest.unlink()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), trees[1])
    logs = []
    got = Checkpointer(tmp_path, cfg).restore_latest_good(abstract, log=logs.append)
    assert got.step == 2 and tree_equal(got.state, trees[2])
    assert "holds non-finite values (in ['params']['w'])" in logs[0]
    assert "had no manifest" in logs[1] and "checksummed now" in logs[1]
    assert (tmp_path / "3.corrupt").is_dir() and (tmp_path / "2" / integrity.MANIFEST).is_file()
    # From now on step 2 is verified like any other: damage after this is caught.
    victim = _largest_file(tmp_path / "2" / "state")
    victim.write_bytes(b"\0" * victim.stat().st_size)
    logs = []
    got = Checkpointer(tmp_path, cfg).restore_latest_good(abstract, log=logs.append)
    assert got.step == 1 and "does not match its checksum" in logs[0]


def test_permanent_checkpoints_survive_keep(tmp_path):
    cfg = CheckpointConfig(async_save=False, keep=1, every_steps=1, permanent_every=2)
    ckpt = Checkpointer(tmp_path, cfg)
    for s in range(1, 6):
        ckpt.save(s, {"x": jnp.asarray(s)}, data_state=None, config={})
    ckpt.close()
    assert ckpt.all_steps() == [2, 4, 5]
    with pytest.raises(ConfigError, match="permanent_every"):
        CheckpointConfig(every_steps=4, permanent_every=6)


def test_model_change_names_fields_but_allows_execution_knobs():
    cfg = small_config()
    saved = cfg.to_dict()
    check_same_model(saved, apply_overrides(cfg, {"execution.attention_impl": "cudnn",
                                                  "execution.remat": "full"}), source="x")
    with pytest.raises(ConfigError, match=r"model.vocab_size: 512 -> 1024"):
        check_same_model(saved, apply_overrides(cfg, {"model.vocab_size": 1024}), source="x")
    # The amax history length is state only under fp8_delayed (a checkpoint saved with the
    # old default of 16 resumes a bf16 run); MX scale rounding is numerics, not state.
    old16 = apply_overrides(cfg, {"execution.fp8_amax_history": 16})
    check_same_model(old16.to_dict(), apply_overrides(cfg, {
        "execution.fp8_amax_history": 1024, "execution.mxfp8_scale_rounding": "floor"}),
        source="x")
    delayed = {"execution.matmul_precision": "fp8_delayed"}
    with pytest.raises(ConfigError, match=r"execution.fp8_amax_history: 16 -> 1024"):
        check_same_model(apply_overrides(old16, delayed).to_dict(), apply_overrides(
            cfg, {**delayed, "execution.fp8_amax_history": 1024}), source="x")
    with pytest.raises(ConfigError, match=r"execution.matmul_precision: 'default' -> "
                                          r"'fp8_delayed' \(fp8_delayed keeps amax"):
        check_same_model(saved, apply_overrides(cfg, delayed), source="x")


def test_a_checkpoint_config_of_before_the_execution_section_resumes():
    """Checkpoints written before the split keep the execution fields in their model
    section: they compare on the model fields alone, the execution ones move over."""
    cfg = small_config()
    old = cfg.to_dict()
    old["model"].update(old.pop("execution"), remat="full", attention_impl="cudnn")
    check_same_model(old, cfg, source="x")
    with pytest.raises(ConfigError, match=r"model.d_model: 128 -> 96"):
        check_same_model(old, apply_overrides(cfg, {"model.d_model": 96}), source="x")


# Another valid value of every field of the model section (Mistral's own included) and of the
# execution section. A new field must be added here, and so be classified: a model field is
# refused by name on resume, an execution field resumes with the other value.
OTHER_MODEL_VALUES = {
    "arch": "qwen3", "vocab_size": 1024, "d_model": 96, "n_layers": 3, "n_heads": 8,
    "n_kv_heads": 4, "head_dim": 32, "ffn_dim": 192, "rope_theta": 10000.0,
    "rope_scaling": "none", "rope_factor": 4.0, "rope_low_freq_factor": 2.0,
    "rope_high_freq_factor": 8.0, "rope_original_max_seq_len": 4096, "max_seq_len": 4096,
    "norm_eps": 1e-6, "tie_embeddings": True, "param_dtype": "bfloat16",
    "sliding_window": 100000,
    # the MoE architectures' (config/moe.py)
    "n_experts": 4, "experts_per_token": 1, "norm_topk_prob": False,
    "router_aux_loss_coef": 0.01, "router_z_loss_coef": 0.001, "router_bias_update_rate": 0.001}
MOE_FIELDS = ("n_experts", "experts_per_token", "norm_topk_prob", "router_aux_loss_coef",
              "router_z_loss_coef", "router_bias_update_rate")
OTHER_EXECUTION_VALUES = {
    "init_std": 0.01, "attention_impl": "cudnn", "context_strategy": "all_gather",
    "tp_overlap": True, "matmul_precision": "highest", "fp8_amax_history": 16,
    "mxfp8_scale_rounding": "floor", "dtype": "bfloat16", "remat": "full",
    "grad_reduce_dtype": "float32", "expert_capacity_factor": 1.25, "attention_check": False,
    "loop_double_buffering": False}


def _mistral_small():
    return small_config(**{"model.arch": "mistral"})


def _arch_small(name: str):
    """small_config of an architecture that has field `name`."""
    if name == "sliding_window":
        return _mistral_small()
    if name in MOE_FIELDS:
        return small_config(**{"model.arch": "mixtral"})
    return small_config()


@pytest.mark.parametrize("name", sorted(OTHER_MODEL_VALUES))
def test_each_model_field_is_refused_by_name_on_resume(name):
    from titanax.archs import ARCHS
    from titanax.config.model import arch_config_class, model_field_names

    assert set(OTHER_MODEL_VALUES) == {n for arch in ARCHS for n in model_field_names(arch)}
    cfg = _arch_small(name)
    assert getattr(cfg.model, name) != OTHER_MODEL_VALUES[name]
    changed = apply_overrides(cfg, {f"model.{name}": OTHER_MODEL_VALUES[name]})
    assert type(changed.model) is arch_config_class(changed.model.arch)  # the arch's own class
    with pytest.raises(ConfigError, match=rf"model\.{name}: "):
        check_same_model(cfg.to_dict(), changed, source="x")


@pytest.mark.parametrize("name", sorted(OTHER_EXECUTION_VALUES))
def test_each_execution_field_may_change_on_resume(name):
    import dataclasses

    from titanax.config import ExecutionConfig

    assert set(OTHER_EXECUTION_VALUES) == {f.name for f in dataclasses.fields(ExecutionConfig)}
    cfg = small_config()
    assert getattr(cfg.execution, name) != OTHER_EXECUTION_VALUES[name]
    check_same_model(cfg.to_dict(), apply_overrides(
        cfg, {f"execution.{name}": OTHER_EXECUTION_VALUES[name]}), source="x")


def test_resume_with_every_execution_field_changed(tmp_path):
    """A run resumes its checkpoint with all of them changed at once (as a resume onto a GPU
    with the planner's suggestions would), and trains on from its step."""
    first, _ = run_small(tmp_path, 1, **{"checkpoint.every_steps": 1})
    changed = {f"execution.{n}": v for n, v in OTHER_EXECUTION_VALUES.items()}
    changed["execution.attention_impl"] = "auto"  # (cudnn needs a GPU; auto is xla on a CPU)
    resumed, log = run_small(tmp_path, 2, **changed, **{"checkpoint.every_steps": 1})
    assert "resumed" in log.lower() and resumed.final_step == 2
    assert sorted(resumed.losses) == [2] and np.isfinite(resumed.losses[2]), log


def _batch(cfg, *, poisoned: bool):
    rng = np.random.default_rng(0)
    B, S, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    toks = rng.integers(0, V, (B, S + 1)).astype(np.int32)
    targets = np.full((B, S), V, np.int32) if poisoned else toks[:, 1:]  # V: out of range
    return {"inputs": toks[:, :-1], "targets": targets, "segment_ids": np.ones((B, S), np.int32),
            "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))}


def test_non_finite_step_keeps_params_and_optimizer_state():
    cfg = small_config()
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    tx = make_optimizer(cfg)
    graphdef, state, _ = create_train_state(cfg, mesh, tx)
    step = jax.jit(make_train_step(cfg, graphdef, tx, lr_schedule(cfg)))
    with model_context(mesh):
        state, m = step(state, _batch(cfg, poisoned=False))
        assert int(m["skipped"]) == 0
        before = jax.device_get(state)
        state, m = step(state, _batch(cfg, poisoned=True))
    assert not np.isfinite(float(m["loss"])) and int(m["skipped"]) == 1
    assert int(state.step) == 2  # the batch was consumed
    assert tree_equal(state.weights, before.weights)
    assert tree_equal(state.opt_state, before.opt_state)


def _poison_data(monkeypatch, bad_steps):
    """Training batches numbered in bad_steps get out-of-range targets (a NaN loss)."""
    real = loop.build_data

    class Poisoned:
        def __init__(self, it, vocab):
            self.it, self.vocab, self.n = it, vocab, 0

        def __iter__(self):
            return self

        def __next__(self):
            batch, self.n = next(self.it), self.n + 1
            if self.n in bad_steps:
                batch = {**batch, "targets": np.full_like(batch["targets"], self.vocab)}
            return batch

        def get_state(self):
            return self.it.get_state()

        def set_state(self, s):
            self.it.set_state(s)

    def build(cfg, *args, **kw):
        data = real(cfg, *args, **kw)
        make = data.train_iterator
        data.train_iterator = lambda: Poisoned(make(), cfg.model.vocab_size)
        return data

    monkeypatch.setattr(loop, "build_data", build)


def test_nan_batch_is_skipped_and_counted_then_too_many_stop(tmp_path, monkeypatch):
    _poison_data(monkeypatch, {3})
    result, _ = run_small(tmp_path / "one", 5, **{"checkpoint.every_steps": 0})
    rows = {r["step"]: r for r in read_metrics(tmp_path / "one") if "loss" in r}
    assert np.isnan(rows[3]["loss"]) and np.isfinite(rows[4]["loss"])
    assert [rows[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]
    assert result.skipped_steps == 1 and np.isfinite(result.val_losses[5])

    _poison_data(monkeypatch, set(range(2, 100)))
    with pytest.raises(loop.TrainingDiverged, match=r"2 consecutive steps .*train.max_bad_steps=2"):
        run_small(tmp_path / "many", 8, **{"checkpoint.every_steps": 0, "train.max_bad_steps": 2})


def test_signals_set_the_stop_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionWatch() as watch:
        assert watch.installed and not watch.stop_requested()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.stop_requested() and watch.describe() == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before
    with pytest.raises(ConfigError, match="max_bad_steps"):
        small_config(**{"train.max_bad_steps": 0})
