"""Circular pipelines store the layer stack stage-major; everything that reads a checkpoint
outside its own run (sampling, HF export) must see the model in logical layer order."""


import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.helpers.small import ROOT, SMALL
from titanax.checkpoint.manager import Checkpointer
from titanax.config import apply_overrides, load_config
from titanax.generate import load_for_inference
from titanax.hf.exporter import export_hf
from titanax.parallel.mesh import build_mesh
from titanax.train.optim import make_optimizer
from titanax.train.state import create_train_state

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

LAYOUT = {"model.n_layers": 4, "execution.dtype": "float32", "train.batch_size": 8}
CIRCULAR = {"mesh.data": 1, "mesh.pipeline": 2, "mesh.fsdp": 4, "pipeline.schedule": "circular",
            "pipeline.microbatches": 2}


def _save_run(tmp_path, name, overrides, devices):
    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.py"),
                          {**SMALL, **LAYOUT, **overrides})
    _, state, _ = create_train_state(cfg, build_mesh(cfg.mesh, devices), make_optimizer(cfg))
    ckpt = Checkpointer(tmp_path / name / "checkpoints", cfg.checkpoint)
    ckpt.save(0, state.to_saved(), data_state=None, config=cfg.to_dict())
    ckpt.close()
    return tmp_path / name


def test_circular_checkpoint_reads_back_in_logical_order(tmp_path):
    plain = _save_run(tmp_path, "plain", {"mesh.data": 1}, jax.devices()[:1])
    circular = _save_run(tmp_path, "circular", CIRCULAR, jax.devices())

    _, _, p_plain, _ = load_for_inference(plain)
    _, _, p_circ, _ = load_for_inference(circular)
    for a, b in zip(jax.tree.leaves(p_plain), jax.tree.leaves(p_circ)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    out_plain, out_circ = tmp_path / "hf_plain", tmp_path / "hf_circ"
    export_hf(plain, out_plain, dtype="float32", progress=False)
    export_hf(circular, out_circ, dtype="float32", progress=False)
    a = {k: v for f in sorted(out_plain.glob("*.safetensors")) for k, v in load_file(f).items()}
    b = {k: v for f in sorted(out_circ.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert a.keys() == b.keys() and "model.layers.3.self_attn.q_proj.weight" in a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_circular_checkpoint_restores_into_an_offloaded_run(tmp_path):
    """Another layout's stack order is fixed on restore also when the run keeps its moments in
    pinned host memory (train.offload_optimizer): they are reordered on the device and go back."""
    from titanax.config import Config
    from titanax.parallel.layer_order import reorder_restored as _match_layer_order
    from titanax.train.state import TrainState, abstract_train_state

    circular = _save_run(tmp_path, "circular", CIRCULAR, jax.devices())
    plain = _save_run(tmp_path, "plain", {"mesh.data": 1}, jax.devices()[:1])
    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.py"),
                          {**SMALL, **LAYOUT, "mesh.data": 1, "mesh.fsdp": 8,
                           "train.offload_optimizer": True})
    mesh = build_mesh(cfg.mesh, jax.devices())
    _, abstract, shardings = abstract_train_state(cfg, mesh, make_optimizer(cfg))
    got = {}
    for name, run in (("circular", circular), ("plain", plain)):
        ckpt = Checkpointer(run / "checkpoints", cfg.checkpoint)
        state, _, saved = ckpt.restore(0, abstract.to_saved())
        ckpt.close()
        got[name] = _match_layer_order(TrainState.from_saved(state), shardings,
                                       Config.from_dict(saved), cfg)
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(got["circular"].opt_state)
             if leaf.ndim}
    assert kinds == {"pinned_host"}
    for a, b in zip(jax.tree.leaves(got["circular"]), jax.tree.leaves(got["plain"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
