"""The planner with context parallelism (mesh.context): activations per device scale with
seq_len / context, parameters and optimizer state with 1 / (fsdp x context), FSDP runs over the
fsdp x context group, the attention's K/V exchange costs what docs/planner.md's formulas say
(ring: hidden under the attention up to its time; all_gather: exposed), the search tries
context degrees, 70B at 65,536 tokens fits 64 H100s with them, and the NeMo-like layout plans
with its real CP 2. Cost model only: no compiles."""

import dataclasses
import json

import pytest

from pallas_kernels import aot
from titanax.config import ConfigError, load_config
from titanax.plan import Cluster, PlanError, make_plan
from titanax.plan import search as plan_search
from titanax.plan.cluster import layout_for, plan_config
from titanax.plan.comm_model import Network
from titanax.plan.cost_model import EFFICIENCIES, estimate, param_counts
from titanax.plan.memory_model import memory_per_device, param_split
from titanax.plan.planner import overrides_for

CONFIG_70B = "configs/llama3_70b.py"
N_70B = 70_553_706_496
LONG = ("train.seq_len=65536", "model.max_seq_len=65536")
NEMO = ("train.batch_size=128", "mesh.tensor=4", "mesh.pipeline=4", "mesh.data=1",
        "pipeline.schedule=circular", "pipeline.virtual_stages=5", "pipeline.microbatches=32",
        "execution.attention_impl=auto")


def _70b(*overrides):
    return load_config(aot.REPO / CONFIG_70B, ["train.grad_accum=1", "execution.attention_impl=auto",
                                               *overrides])


def _deg(**kw):
    return {"pipeline": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, **kw}


def _estimate(cluster, *overrides, eff=EFFICIENCIES):
    cfg = plan_config(_70b(*overrides), cluster)
    return cfg, estimate(cfg, cluster, layout_for(cfg, cluster), eff)


def test_context_2_halves_activations_and_shards_state_over_fsdp_x_context():
    cfg = _70b("train.batch_size=8")
    one, _ = memory_per_device(cfg, _deg(fsdp=4))
    two, _ = memory_per_device(cfg, _deg(fsdp=4, context=2))
    # the same rows per device, half of each sequence
    assert two["saved_activations"] == pytest.approx(one["saved_activations"] / 2)
    assert two["saved_activations"] == pytest.approx(80 * 2 * 4096 * 8192 * 2)
    # parameters, gradients and Adam's moments: sharded over fsdp x context = 8
    for part in ("weights", "optimizer", "gradients"):
        assert two[part] == pytest.approx(one[part] / 2)
    assert two["weights"] + two["optimizer"] == pytest.approx(12 * N_70B / 8)
    assert "context_kv" in two and "context_kv" not in one


def test_params_divide_by_fsdp_x_context():
    cfg = _70b()
    assert param_counts(cfg)[0] == N_70B
    assert param_split(cfg, _deg(fsdp=4, context=2)) == param_split(cfg, _deg(fsdp=8))
    split = param_split(cfg, _deg(fsdp=2, context=4, tensor=2, pipeline=2))
    other = 2 * 128256 * 8192 + 8192  # embedding, output layer, final norm: every stage
    assert split.layers == pytest.approx((N_70B - other) / (2 * 4 * 2 * 2))
    assert split.other == pytest.approx(other / (2 * 4 * 2))


def test_context_kv_buffers_per_strategy():
    # one K block: 1 row x 65536/8 tokens x 8 kv heads x 128, bf16; ring: K, V and their
    # float32 gradients, double-buffered; all_gather: all 8 blocks of each at once
    block = 8192 * 8 * 128
    for strategy, want in (("ring", 2 * 2 * block * (2 + 4)),
                           ("all_gather", 2 * 8 * block * (2 + 4))):
        cfg = _70b(*LONG, "train.batch_size=8", f"execution.context_strategy={strategy}")
        mem, _ = memory_per_device(cfg, _deg(fsdp=8, context=8))
        assert mem["context_kv"] == pytest.approx(want)


def test_ring_comm_bytes_and_overlap_per_formula():
    cluster = Cluster("h100", 1)
    cfg, est = _estimate(cluster, *LONG, "train.batch_size=1", "mesh.fsdp=-1",
                         "mesh.context=8")
    assert est.comm["context"].degree == 8 and est.comm["context"].link == "nvlink"
    # per layer: full remat runs attention's forward twice, each with 7 sends of K and V;
    # the backward 7 more of K, V and 8 of the float32 dK, dV. A K block is 1 row x 8192
    # tokens x 8 kv heads x 128 x 2 bytes.
    kv = 2 * 8192 * 8 * 128 * 2
    want = 80 * (3 * 7 * kv + 8 * 2 * kv)
    c = est.comm["context"]
    assert c.bytes_per_step == pytest.approx(want)
    assert c.calls == 80 * (3 * 7 + 8)
    assert c.bus_bandwidth == pytest.approx(450e9 * EFFICIENCIES.nvlink)  # one NVLink hop
    assert c.hidden_s == pytest.approx(c.seconds) and c.exposed_s == 0  # under the attention
    assert est.breakdown_s["exposed_comm"] == 0
    # a link 1000x slower: the sends outlast the attention, the excess is exposed
    slow = dataclasses.replace(EFFICIENCIES, nvlink=0.0008)
    _, est_slow = _estimate(cluster, *LONG, "train.batch_size=1", "mesh.fsdp=-1",
                            "mesh.context=8", eff=slow)
    c = est_slow.comm["context"]
    assert c.hidden_s == pytest.approx(est_slow.breakdown_s["attention"] * 7 / 8)
    assert c.exposed_s == pytest.approx(c.seconds - c.hidden_s)
    assert est_slow.breakdown_s["exposed_comm"] == pytest.approx(c.exposed_s)


def test_all_gather_comm_bytes_per_formula_and_exposed():
    cluster = Cluster("h100", 1)
    _, est = _estimate(cluster, *LONG, "train.batch_size=1", "mesh.fsdp=-1", "mesh.context=8",
                       "execution.context_strategy=all_gather")
    c = est.comm["context"]
    kv = 2 * 8192 * 8 * 128 * 2
    # three all-gathers (two forwards, the backward) each receiving 7 blocks of K and V, one
    # reduce-scatter of the float32 dK, dV (7/8 of 8 blocks)
    assert c.bytes_per_step == pytest.approx(80 * (3 * 7 * kv + 7 * 2 * kv))
    assert c.calls == 80 * 4
    assert c.hidden_s == 0 and c.exposed_s == pytest.approx(c.seconds)
    assert est.breakdown_s["exposed_comm"] == pytest.approx(c.seconds)


def test_fsdp_runs_over_the_fsdp_x_context_group():
    cluster = Cluster("h100", 8)  # context 8 fills each node's NVLink; fsdp crosses nodes
    cfg, est = _estimate(cluster, *LONG, "train.batch_size=32", "mesh.fsdp=-1",
                         "mesh.context=8")
    layout = layout_for(cfg, cluster)
    assert layout.inner["context"] == 8 and layout.outer["fsdp"] == 8
    c = est.comm["fsdp"]
    assert c.degree == 64 and c.over == ("fsdp", "context")
    n = param_counts(cfg)[0]
    assert c.bytes_per_step == pytest.approx(63 / 64 * n * (2 + 2 + 2))
    # one ring through 64 GPUs: 8 per node, each on its own rail
    assert c.link == "infiniband"
    assert c.bus_bandwidth == pytest.approx(min(450e9, 8 * 50e9) * EFFICIENCIES.ib)
    assert "fsdp" in est.comm and "context" in est.comm  # the K/V exchange apart


def test_group_bandwidth_is_the_slowest_link():
    cluster = Cluster("h100", 2)
    cfg = plan_config(_70b("train.batch_size=16", "mesh.tensor=2", "mesh.context=2",
                           "mesh.fsdp=4"), cluster)
    net = Network(layout_for(cfg, cluster), cluster, EFFICIENCIES)
    # tensor 2 x context 2 x fsdp 2 inside a node, fsdp 2 across: context alone stays on
    # NVLink, fsdp x context crosses on 2 x 2 = 4 rails per node
    assert net.bus_bandwidth("context")[0] == "nvlink"
    link, bw, _ = net.bus_bandwidth(("fsdp", "context"))
    assert link == "infiniband" and bw == pytest.approx(4 * 50e9 * EFFICIENCIES.ib)
    assert net.bus_bandwidth(("fsdp", "context")) != net.bus_bandwidth("context")


def test_tensor_and_elementwise_work_per_device_shrink_with_context():
    cluster = Cluster("h100", 1)
    _, est1 = _estimate(cluster, "train.batch_size=8", "mesh.tensor=2", "mesh.fsdp=4")
    _, est2 = _estimate(cluster, "train.batch_size=8", "mesh.tensor=2", "mesh.fsdp=2",
                        "mesh.context=2")
    # fsdp 4 -> fsdp 2 x context 2: the same tokens per device, so the same TP traffic,
    # GEMM, attention and elementwise time; attention is balanced over the context ranks
    assert est2.comm["tensor"].bytes_per_step == pytest.approx(est1.comm["tensor"].bytes_per_step)
    for k in ("gemm", "attention", "elementwise"):
        assert est2.breakdown_s[k] == pytest.approx(est1.breakdown_s[k])
    _, est4 = _estimate(cluster, "train.batch_size=8", "mesh.tensor=2", "mesh.fsdp=2",
                        "mesh.data=2", "mesh.context=1")
    # fsdp 2 x context 2 against fsdp 2 x data 2: each device holds half the tokens
    assert est2.comm["tensor"].bytes_per_step == pytest.approx(
        est4.comm["tensor"].bytes_per_step)


def test_a_sequence_that_does_not_split_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"does not split over mesh.context=8.*multiple of 16"):
        _70b("train.seq_len=4104", "mesh.context=8", "mesh.fsdp=1")
    # -1 resolved on the cluster: refused by the planner with the same message
    with pytest.raises(PlanError, match=r"does not split over mesh.context=8"):
        make_plan(_70b("train.seq_len=4104", "train.batch_size=8", "mesh.context=-1",
                       "mesh.fsdp=8"), Cluster("h100", 8), compile_step=False)


def test_cli_refuses_an_unsplittable_sequence_with_exit_2(capsys):
    from launch import plan as launch_plan

    with pytest.raises(SystemExit) as e:
        launch_plan.main(["--config", CONFIG_70B, "--gpu", "h100", "--nodes", "1",
                          "--no-compile", "--set", "execution.attention_impl=auto",
                          "--set", "mesh.context=8", "--set", "mesh.fsdp=1",
                          "--set", "train.seq_len=4100"])
    assert e.value.code == 2
    assert "does not split over mesh.context=8" in capsys.readouterr().err


def test_search_tries_context_degrees_within_the_nvlink_domain():
    cluster = Cluster("h100", 8)
    cfg = plan_config(_70b(*LONG, "train.batch_size=32"), cluster)
    seen = {(o["mesh.tensor"], o["mesh.context"], o["execution.context_strategy"])
            for _, o in plan_search.candidates(cfg, cluster)}
    assert {(1, 8, "ring"), (1, 8, "all_gather"), (2, 4, "ring"), (4, 2, "all_gather")} <= seen
    assert all(tp * cp <= 8 for tp, cp, _ in seen)
    assert not any(cp > 1 for tp, cp, _ in seen if tp == 8)
    # --max-context 1: the search as it was before context parallelism
    assert {o["mesh.context"] for _, o in plan_search.candidates(cfg, cluster, 1)} == {1}
    assert {o["mesh.context"] for _, o in plan_search.candidates(cfg, cluster, 4)} == {1, 2, 4}


def test_search_finds_a_context_layout_for_70b_at_64k_on_64_h100(monkeypatch):
    # the full search takes ~20 s on this machine; one remat and no offload keep it short
    monkeypatch.setattr(plan_search, "REMATS", ("full",))
    monkeypatch.setattr(plan_search, "OFFLOADS", ((False, False),))
    monkeypatch.setattr(plan_search, "MICROBATCH_MULTIPLES", (1,))
    cluster = Cluster("h100", 8)
    kept, dropped = plan_search.search(plan_config(_70b(*LONG, "train.batch_size=32"),
                                                   cluster), cluster)
    best = kept[0]
    assert best.cfg.mesh.context > 1 and best.estimate.fits
    assert best.estimate.memory["total"] < 76e9
    assert any(c.cfg.mesh.context > 1 for c in dropped)  # too big, or too few rows
    # the fastest layout without context parallelism is slower
    no_cp = [c for c in kept if c.cfg.mesh.context == 1]
    assert no_cp[0].estimate.tokens_per_s_per_gpu < best.estimate.tokens_per_s_per_gpu
    flags = overrides_for(best.cfg)
    assert f"mesh.context={best.cfg.mesh.context}" in flags
    assert f"execution.context_strategy={best.cfg.execution.context_strategy}" in flags


def test_whole_64k_sequences_do_not_fit_an_h100_and_context_8_does():
    cluster = Cluster("h100", 8)
    _, whole = _estimate(cluster, *LONG, "train.batch_size=64", "mesh.fsdp=-1")
    # one sequence per GPU, the least without context parallelism: 80 layer inputs of
    # 65536 x 8192 bf16 for full remat
    assert whole.memory["saved_activations"] == pytest.approx(80 * 65536 * 8192 * 2)
    assert not whole.fits
    # context 8 and one row per accumulation microbatch: an eighth of a sequence per GPU
    _, split = _estimate(cluster, *LONG, "train.batch_size=64", "mesh.fsdp=-1",
                         "mesh.context=8", "train.grad_accum=8")
    assert split.memory["saved_activations"] == pytest.approx(80 * 8192 * 8192 * 2)
    assert split.fits


def test_nemo_like_layout_with_cp2_plans_and_fits(tmp_path, capsys):
    from launch import plan as launch_plan

    cluster = Cluster("h100", 8)
    cp = make_plan(_70b(*NEMO, "mesh.fsdp=2", "mesh.context=2"), cluster, compile_step=False)
    proxy = make_plan(_70b(*NEMO, "mesh.fsdp=4"), cluster, compile_step=False)
    assert cp["layout"]["degrees"] == {"pipeline": 4, "data": 1, "fsdp": 2, "expert": 1, "context": 2,
                                       "tensor": 4}
    # tensor then context fill the node; pipeline and fsdp cross nodes
    assert cp["layout"]["inside_nvlink_domain"]["context"] == 2
    assert cp["fits"]
    # the state is sharded 4 ways, as fsdp=4 shards it
    for part in ("weights", "optimizer", "gradients"):
        assert cp["memory_model_bytes"][part] == pytest.approx(proxy["memory_model_bytes"][part])
    comm = cp["communication_bytes_per_step"]
    assert comm["context"]["degree"] == 2 and comm["fsdp"]["mesh_axes"] == ["fsdp", "context"]
    assert cp["predicted_tokens_per_s_per_gpu"] > 0.9 * proxy["predicted_tokens_per_s_per_gpu"]
    launch_plan.main(["--config", CONFIG_70B, "--gpu", "h100", "--nodes", "8", "--no-compile",
                      *[a for o in NEMO for a in ("--set", o)], "--set", "mesh.fsdp=2",
                      "--set", "mesh.context=2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "context=2" in out and "context 2 (ring: 4096 tokens" in out
    assert "over fsdp x context" in out and "hidden under attention" in out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["settings"]["context_strategy"] == "ring"
    assert (tmp_path / "plan.png").stat().st_size > 10_000
