"""Pipeline schedules: the tick tables, the stage-major layer order, busy ticks counted by the
compiled pipeline itself, and a launch-path run with tensor, data and pipeline all > 1 that
checkpoints and resumes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from titanax.config import Config, MeshConfig, apply_overrides
from titanax.parallel.layer_order import (
    storage_permutation,
    stored_layer_order,
    to_logical_order,
    to_storage_order,
)
from titanax.parallel.mesh import build_mesh
from titanax.parallel.pipeline import (
    PipelineSchedule,
    bubble_fraction,
    run_pipelined,
    schedule_table,
)

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices


@pytest.mark.parametrize("stages,micro,virtual", [(4, 8, 1), (4, 16, 1), (4, 8, 2), (4, 16, 2),
                                                  (2, 1, 1)])
def test_schedule_table_runs_every_item_once_in_order(stages, micro, virtual):
    table = schedule_table(stages, micro, virtual)
    assert table.shape == (micro * virtual + stages - 1, stages)
    for s in range(stages):
        items = table[:, s][table[:, s] >= 0]
        assert items.tolist() == list(range(micro * virtual))
    idle = (table < 0).mean()
    assert idle == pytest.approx(bubble_fraction(stages, micro, virtual))


def test_circular_items_come_back_to_stage_zero_after_leaving_the_last():
    stages, micro, virtual = 4, 8, 2
    table = schedule_table(stages, micro, virtual)
    for item in range(micro, micro * virtual):  # item's previous trip: item - micro
        leaves_last = np.argwhere(table[:, -1] == item - micro)[0, 0]
        starts = np.argwhere(table[:, 0] == item)[0, 0]
        assert starts > leaves_last


def test_storage_order_puts_chunks_s_s_plus_pp_on_stage_s():
    perm = storage_permutation(16, stages=4, virtual_stages=2)  # chunks of 2 layers
    rows_of_stage_1 = perm[4:8]  # stage 1 holds stored rows 4..7
    assert rows_of_stage_1.tolist() == [2, 3, 10, 11]  # logical chunks 1 and 1 + 4
    x = {"w": jnp.arange(16.0)[:, None] * jnp.ones((16, 3))}
    back = to_logical_order(to_storage_order(x, 4, 2), 4, 2)
    np.testing.assert_array_equal(back["w"], x["w"])
    assert to_storage_order(x, 4, 1) is x  # gpipe keeps the logical order


@pytest.mark.parametrize("micro,virtual", [(8, 1), (8, 2)])
def test_compiled_pipeline_busy_ticks_and_values(micro, virtual):
    """A toy layer (x * w + 1) on a PP4 mesh: the outputs equal the sequential stack, and the
    busy ticks the program counts give the analytic idle fraction."""
    stages, L = 4, 8
    mesh = build_mesh(MeshConfig(data=2, pipeline=stages))
    w_L = jnp.linspace(0.5, 1.5, L)
    x_B = jnp.arange(16.0)
    expect = x_B
    for layer in range(L):
        expect = expect * w_L[layer] + 1.0
    with jax.set_mesh(mesh):
        stored = to_storage_order(w_L, stages, virtual)
        out, busy = jax.jit(lambda w, x: run_pipelined(
            lambda h, wl, _: h * wl + 1.0, w, x, None, PipelineSchedule(micro, virtual),
            with_busy=True))(stored, x_B)
    np.testing.assert_allclose(out, expect, rtol=1e-6)
    ticks = micro * virtual + stages - 1
    assert busy.tolist() == [micro * virtual] * stages
    assert 1 - busy.sum() / (ticks * stages) == pytest.approx(bubble_fraction(stages, micro, virtual))


def test_train_with_tensor_data_pipeline_checkpoints_and_resumes(tmp_path):
    from titanax.train.loop import train

    over = {"model.d_model": 32, "model.n_layers": 4, "model.n_heads": 4, "model.n_kv_heads": 2,
            "model.ffn_dim": 64, "model.vocab_size": 128, "execution.dtype": "float32",
            "train.batch_size": 8, "train.seq_len": 16, "train.eval_batches": 1,
            "train.steps": 2, "train.log_every": 1, "train.eval_every": 0,
            "train.progress_bar": False, "data.source": "synthetic",
            "checkpoint.every_steps": 2, "checkpoint.async_save": False,
            "mesh.data": 2, "mesh.tensor": 2, "mesh.pipeline": 2, "mesh.nvlink_domain": 4,
            "pipeline.microbatches": 2, "pipeline.schedule": "circular"}
    logs = []
    first = train(apply_overrides(Config(), over), tmp_path, log=logs.append)
    assert first.final_step == 2 and (tmp_path / "checkpoints" / "2").is_dir()
    assert "2 NVLink domain(s) of 4" in "\n".join(logs)
    second = train(apply_overrides(Config(), {**over, "train.steps": 3}), tmp_path,
                   log=logs.append)
    assert second.final_step == 3 and any("resumed from" in line for line in logs)
    assert np.isfinite(second.losses[3]) and second.losses[3] < np.log(128) + 0.5


def test_stored_layer_order_from_a_run_config():
    cfg = apply_overrides(Config(), {"model.n_layers": 8, "mesh.pipeline": 4, "mesh.data": 2,
                                     "pipeline.schedule": "circular",
                                     "pipeline.microbatches": 4})
    np.testing.assert_array_equal(stored_layer_order(cfg), storage_permutation(8, 4, 2))
    assert stored_layer_order(Config()) is None
