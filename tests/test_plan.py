"""The planner (titanax.plan, launch/plan.py): the deviceless compile of the real 70B train step
for H100 clusters, the fits / does-not-fit verdicts with their numbers, FLOPs equal to the
README formula, the cost model's pieces computed by hand, the layout search, and the files.
Compiles run in a subprocess with the CUDA plugin (.venv/cuda-plugin); they skip without it."""

import json
import subprocess
import sys
import time

import pytest

from pallas_kernels import aot
from titanax.config import load_config
from titanax.plan import Cluster, PlanError, make_plan
from titanax.plan.cluster import layout_for, plan_config
from titanax.plan.cost_model import EFFICIENCIES, estimate, param_counts
from titanax.plan.report import format_plan
from titanax.plan.search import search
from titanax.train import throughput

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

CONFIG_70B = "configs/llama3_70b.py"
needs_plugin = pytest.mark.skipif(not aot.plugin_available(), reason="CUDA plugin not installed "
                                  "in .venv/cuda-plugin (bash scripts/dev.sh cuda-plugin installs it)")


def _70b(*overrides):
    return load_config(aot.REPO / CONFIG_70B, ["train.grad_accum=1", *overrides])


@needs_plugin
def test_70b_on_64_h100_compiles_fast_and_fits(tmp_path):
    # MaxText's and NeMo's 70B runs use 128 sequences of 8192 per 64 GPUs' step; the config's
    # 256 needs grad_accum on 64 GPUs (see test_70b_batch_256_needs_accumulation_on_64).
    t0 = time.perf_counter()
    plan = make_plan(_70b("train.batch_size=128"), Cluster("h100", 8))
    wall = time.perf_counter() - t0
    comp = plan["compile"]
    assert comp["ok"], comp
    assert comp["target"] == "gpu" and comp["device_kind"].startswith("NVIDIA H100")
    assert comp["devices"] == 64 and comp["processes"] == 8
    assert "8 NVLink domain(s) of 8" in comp["mesh"]
    assert wall < 120, f"plan took {wall:.0f} s"
    m = comp["memory"]
    # fp32 weights + two fp32 Adam moments, sharded 64 ways: 12 bytes x 70.55e9 / 64
    assert m["arguments"] == pytest.approx(12 * 70_553_706_496 / 64, rel=0.01)
    assert 40e9 < m["total"] < 76e9, m
    assert plan["fits"] and plan["per_device_bytes"] == m["total"]
    assert plan["per_device_bytes_source"] == "compiled"
    # the cost model agrees with the compiler to within 15%
    assert plan["memory_model_bytes"]["total"] == pytest.approx(m["total"], rel=0.15)
    assert plan["compiled_for"].startswith("deviceless CUDA NVIDIA H100")


def test_70b_on_8_h100_does_not_fit_with_numbers(tmp_path, capsys):
    from launch import plan as launch_plan

    launch_plan.main(["--config", CONFIG_70B, "--gpu", "h100", "--nodes", "1",
                      "--no-compile", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "DOES NOT FIT by" in out and "weights 35.3 GB, optimizer 70.6 GB" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["fits"] is False and plan["device_memory_bytes"] == 80e9


def test_70b_on_8_h100_plan_numbers():
    cluster = Cluster("h100", 1)
    plan = make_plan(_70b(), cluster, compile_step=False)
    assert not plan["fits"]
    # weights and Adam alone: 12 bytes x 70.55e9 / 8 = 105.8 GB > 80 GB
    mem = plan["memory_model_bytes"]
    assert mem["weights"] + mem["optimizer"] == pytest.approx(12 * 70_553_706_496 / 8, rel=1e-6)
    assert plan["per_device_bytes"] > plan["device_memory_bytes"]
    assert plan["margin_bytes"] < -25e9


@needs_plugin
def test_70b_on_8_h100_compiled_does_not_fit():
    plan = make_plan(_70b("train.batch_size=8"), Cluster("h100", 1))
    assert plan["compile"]["ok"], plan["compile"]
    assert plan["per_device_bytes_source"] == "compiled"
    assert plan["compile"]["memory"]["arguments"] > 100e9  # 105.8 GB of state alone
    assert not plan["fits"] and plan["margin_bytes"] < -25e9


def test_offload_moves_state_to_host_in_the_model_and_costs_host_time():
    cluster = Cluster("h100", 1)
    base = make_plan(_70b("train.batch_size=8"), cluster, compile_step=False)
    off = make_plan(_70b("train.batch_size=8", "train.offload_optimizer=true",
                         "execution.remat=full_offload"), cluster, compile_step=False)
    n = 70_553_706_496
    assert off["memory_model_bytes"]["optimizer"] == 0
    host = off["host_memory_model_bytes"]
    assert host["optimizer"] == pytest.approx(8 * n / 8, rel=1e-6)
    assert host["saved_activations"] == pytest.approx(80 * 8192 * 8192 * 2, rel=1e-6)
    assert off["memory_model_bytes"]["total"] < base["memory_model_bytes"]["total"] - 75e9
    # the moments cross PCIe both ways after the backward: exposed time, 8 bytes per parameter
    exposed = off["time_breakdown_s"]["host_offload_exposed"]
    assert exposed == pytest.approx(8 * n / 8 / (64e9 * 0.8), rel=0.01)
    assert off["predicted_step_s"] > base["predicted_step_s"]
    # what the offload costs, said beside the prediction (full_offload recomputes as full)
    assert off["host_offload_cost_s"] == pytest.approx(
        off["predicted_step_s"] - base["predicted_step_s"], rel=0.02)
    assert "host offload costs" in format_plan(off) and "host offload" not in format_plan(base)
    # the layers' weights on the host with gradient accumulation: the sum stays on the device
    # (summed in place), the weights cross the host link twice per microbatch
    both = make_plan(_70b("train.offload_optimizer=true", "train.offload_params=true",
                          "train.grad_accum=16"), cluster, compile_step=False)
    assert "gradients" not in both["host_memory_model_bytes"]
    assert both["memory_model_bytes"]["gradients"] == pytest.approx(4 * n / 8, rel=0.01)
    assert both["memory_model_bytes"]["accumulation"] > 0
    assert both["time_breakdown_s"]["host_offload_overlapped"] > 0


def test_1f1b_activations_do_not_grow_with_microbatches_in_the_model():
    cluster = Cluster("h100", 8)
    saved = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (8, 32):
            cfg = _70b("train.batch_size=128", "mesh.tensor=4", "mesh.pipeline=4",
                       "mesh.fsdp=4", "mesh.data=1", f"pipeline.schedule={schedule}",
                       f"pipeline.microbatches={m}")
            plan = make_plan(cfg, cluster, compile_step=False)
            saved[schedule, m] = plan["memory_model_bytes"]["saved_activations"]
    # same tokens per step: gpipe keeps every tick's layer inputs, 1f1b at most 2PP-1 in flight
    assert saved["gpipe", 32] > 0.75 * saved["gpipe", 8]  # the whole step's layer inputs
    assert saved["1f1b", 32] < 0.5 * saved["1f1b", 8]


def test_flops_per_token_is_the_readme_formula():
    cfg = _70b()
    plan = make_plan(cfg, Cluster("h100", 8), compile_step=False)
    n_no_embed = param_counts(cfg)[1]
    want = throughput.flops_per_token(cfg.model, cfg.train.seq_len, n_no_embed)
    assert plan["flops_per_token"] == want
    assert plan["flops_per_token"] == pytest.approx(4.81e11, rel=0.005)  # DESIGN.md's number
    assert plan["flops_per_step"] == want * 256 * 8192
    assert plan["flop_formula"] == throughput.FLOP_FORMULA


def test_pipeline_bubble_and_hand_computed_communication():
    cluster = Cluster("h100", 2)  # 16 GPUs, two NVLink domains
    cfg = plan_config(_70b("mesh.fsdp=-1", "mesh.pipeline=2", "mesh.tensor=2",
                           "pipeline.microbatches=8", "train.batch_size=32"), cluster)
    layout = layout_for(cfg, cluster)
    assert layout.degrees == {"pipeline": 2, "data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}
    # tensor, then fsdp fill a domain of 8; pipeline crosses domains
    assert layout.inner == {"pipeline": 1, "data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 2}
    est = estimate(cfg, cluster, layout)
    assert est.bubble == pytest.approx((2 - 1) / (8 + 2 - 1))
    n_params = param_counts(cfg)[0]
    # FSDP: forward and backward all-gathers and a gradient reduce-scatter of the bf16 weights
    # of this tensor x pipeline shard, each moving 3/4 of them
    fsdp = est.comm["fsdp"]
    assert fsdp.bytes_per_step == pytest.approx(3 * 0.75 * n_params / (2 * 2) * 2)
    assert fsdp.link == "nvlink"
    assert fsdp.bus_bandwidth == pytest.approx(450e9 * EFFICIENCIES.nvlink)
    # TP (XLA's collectives, execution.tp_overlap off): per layer the forward, the pipeline tick's
    # recompute of it and the backward gather twice and reduce twice each, full remat's
    # recompute gathers twice and reduces once (w_down's output is not needed again): 8
    # all-gathers and 7 whole-sequence all-reduces (twice the bytes: XLA all-reduces and
    # slices), 22 units; 40 layers per stage, 8 microbatches of 32/4/8 = 1 sequence of 8192
    # tokens, 1/2 of [8192, 8192] bf16 per unit
    tp = est.comm["tensor"]
    assert tp.bytes_per_step == pytest.approx((8 + 2 * 7) * 40 * 8 * 0.5 * 8192 * 8192 * 2)
    # PP across two nodes: one rail, (8 + 2 - 1) iterations, forward and backward, of one
    # microbatch's sequence-sharded activations
    pp = est.comm["pipeline"]
    assert pp.link == "infiniband"
    assert pp.bus_bandwidth == pytest.approx(50e9 * EFFICIENCIES.ib)
    assert pp.bytes_per_step == pytest.approx(2 * 9 * 8192 * 8192 * 2 / 2)
    circ = estimate(plan_config(_70b("mesh.fsdp=-1", "mesh.pipeline=2", "mesh.tensor=2",
                                     "pipeline.microbatches=8", "train.batch_size=32",
                                     "pipeline.schedule=circular",
                                     "pipeline.virtual_stages=4"), cluster), cluster, layout)
    assert circ.bubble == pytest.approx(est.bubble / 4)


def test_cross_domain_axis_is_bottlenecked_by_its_rails():
    cluster = Cluster("h100", 8)
    cfg = plan_config(_70b("train.batch_size=128"), cluster)  # fsdp=64: 8 inside x 8 across
    est = estimate(cfg, cluster, layout_for(cfg, cluster))
    c = est.comm["fsdp"]
    assert c.link == "infiniband"
    # eight GPUs of a node drive eight rails: 8 x 50 GB/s x 0.8, under NVLink's 450 x 0.8
    assert c.bus_bandwidth == pytest.approx(min(450e9, 8 * 50e9) * 0.8)


def test_gb200_nvlink_domain_spans_trays():
    assert Cluster("gb200", 18).gpus_per_node == 4
    assert Cluster("gb200", 18).nvlink_domain == 72
    assert Cluster("gb200", 16).nvlink_domain == 64
    assert Cluster("gb200", 36).nvlink_domain == 72
    assert Cluster("h100", 4).nvlink_domain == 8


def test_search_ranks_fitting_layouts_and_says_why_others_drop():
    cluster = Cluster("h100", 8)
    kept, dropped = search(plan_config(_70b(), cluster), cluster)
    assert kept and dropped
    speeds = [round(c.estimate.tokens_per_s_per_gpu, 1) for c in kept]
    assert speeds == sorted(speeds, reverse=True)  # ties: the one with more memory to spare
    assert all(c.estimate.fits for c in kept)
    reasons = {c.dropped.split(":")[0] for c in dropped}
    assert {"does not fit", "invalid"} <= reasons
    assert any("train.batch_size" in c.dropped for c in dropped)
    assert all(c.dropped for c in dropped)


def test_plan_cli_writes_json_and_png(tmp_path):
    out = tmp_path / "plan"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.plan", "--config", CONFIG_70B, "--gpu", "b200",
         "--nodes", "1", "--set", "train.batch_size=32", "--no-compile", "--search",
         "--out", str(out)], capture_output=True, text=True, cwd=aot.REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads((out / "plan.json").read_text())
    for key in ("params", "per_device_bytes", "device_memory_bytes", "fits",
                "predicted_tokens_per_s_per_gpu", "predicted_mfu", "compiled_for"):
        assert key in plan, key
    assert plan["compiled_for"] == "none (cost model only)"
    assert plan["search"]["ranked"] and plan["search"]["best"]["label"]
    assert (out / "plan.png").stat().st_size > 10_000
    assert "tokens/s per GPU" in proc.stdout and "search:" in proc.stdout
    # The prediction carries the spread of published runs against the model.
    spread, tps = plan["predicted_tokens_per_s_spread"], plan["predicted_tokens_per_s_per_gpu"]
    assert spread["low"] < tps < spread["high"]
    assert {r["run"].split(",")[0] for r in spread["published_rows"]} == {
        "NeMo", "MaxText", "Together AI (TorchTitan"}
    assert spread["low_ratio"] == min(r["published"] / r["predicted"]
                                      for r in spread["published_rows"])
    assert "how sure: " in proc.stdout and "published 70B runs came in at" in proc.stdout
    # Nothing was compiled: the winner says so, not that earlier candidates failed.
    assert plan["search"]["best"]["unchecked_why"] == "--no-compile"
    assert "NOT compile-checked: --no-compile" in proc.stdout


def test_plan_without_the_plugin_says_memory_is_a_guess_and_how_to_install(
        tmp_path, monkeypatch, capsys):
    """No CUDA plugin: the step compiles for simulated CPU devices, whose memory is never
    given as the GPU's; the plan says the memory is the cost model's and names the one
    command that installs the plugin. A run's config.json is a --config like any other."""
    from launch import plan as launch_plan
    from titanax.config import apply_overrides

    monkeypatch.setattr(aot, "plugin_available", lambda: False)
    cfg = apply_overrides(load_config(aot.REPO / "configs/tiny.py"), {"mesh.data": -1})
    saved = tmp_path / "run" / "config.json"
    saved.parent.mkdir()
    saved.write_text(json.dumps(cfg.to_dict()))
    launch_plan.main(["--config", str(saved), "--gpu", "h100", "--nodes", "1",
                      "--out", str(tmp_path / "plan")])
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["compile"]["ok"] and plan["compile"]["target"] == "cpu"
    assert plan["per_device_bytes_source"] == "cost model"
    assert "the memory below is the cost model's guess" in out
    assert "`bash scripts/dev.sh cuda-plugin` installs the plugin" in out
    assert "compiled (cpu)" not in out and "is not the GPU's and is not used here" in out


@pytest.mark.parametrize("args, message", [
    (["--gpu", "a100", "--nodes", "1"], "--gpu 'a100' is unknown"),
    (["--gpu", "h100", "--nodes", "0"], "--nodes must be >= 1"),
    (["--gpu", "h100", "--nodes", "1", "--set", "mesh.tensor=16"], "mesh.tensor=16"),
])
def test_plan_cli_bad_input_exits_2(args, message, capsys):
    from launch import plan as launch_plan

    with pytest.raises(SystemExit) as e:
        launch_plan.main(["--config", CONFIG_70B, "--no-compile", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_unknown_gpu_is_a_plan_error():
    with pytest.raises(PlanError, match="choose one of"):
        Cluster("v100", 1)
