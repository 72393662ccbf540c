"""The planner for mixture-of-experts models (issue 37, docs/moe.md, Planner): the parameters,
gradients and optimizer state per device equal the built model's shards (the experts over
expert x fsdp x context x tensor, the router not over tensor) and a tiny model's rows by hand;
expert parallelism's all-to-all bytes by hand (dropless and with a capacity factor) on the
link the 'expert' axis lands on; the plan says what dropless costs; --search tries expert
degrees for an MoE model only. Cost model only (no compile)."""

import math

import jax
import pytest

from tests.helpers.layouts import tiny_config
from titanax.config import ConfigError
from titanax.parallel.mesh import build_mesh
from titanax.plan import Cluster, PlanError, make_plan
from titanax.plan.cluster import layout_for, plan_config
from titanax.plan.comm_model import Network
from titanax.plan.cost_model import EFFICIENCIES, estimate, param_counts
from titanax.plan.memory_model import param_split
from titanax.plan.report import format_plan
from titanax.plan.search import candidates, search
from titanax.train.optim import make_optimizer
from titanax.train.state import abstract_train_state

# L=2 layers of E=4 experts (top K=2) of width F=16, D=32, 4 heads (2 kv) of 8, V=128.
L, E, K, D, F, H, KV, HD, V = 2, 4, 2, 32, 16, 4, 2, 8, 128
MOE = {"model.arch": "qwen3_moe", "model.n_experts": E, "model.experts_per_token": K,
       "model.n_layers": L, "model.ffn_dim": F, "model.head_dim": HD, "mesh.data": 1,
       "execution.dtype": "bfloat16"}
H100 = Cluster("h100", 1)  # 8 GPUs, one NVLink domain


def _moe(**over):
    return tiny_config(**{**MOE, **over})


def _estimate(cfg, cluster=H100):
    cfg = plan_config(cfg, cluster)
    return estimate(cfg, cluster, layout_for(cfg, cluster))


def _elements_per_device(tree, shardings) -> int:
    return sum(math.prod(s.shard_shape(x.shape)) for x, s in
               zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True))


def _by_hand(ep: int, fsdp: int, tp: int = 1) -> float:
    """Parameters per device of the tiny model, each kind as parallel/rules.py splits it."""
    experts = 3 * L * E * D * F / (ep * fsdp * tp)  # w_gate, w_up, w_down
    router = L * D * E / fsdp  # [L, D, E]: 'router_experts' on no mesh axis
    attention = L * D * (2 * H + 2 * KV) * HD / (fsdp * tp)  # wq, wo; wk, wv
    norms = L * (2 * D + 2 * HD)  # attn/mlp norms, q/k norms: replicated
    return experts + router + attention + norms + 2 * V * D / (fsdp * tp) + D


@pytest.mark.parametrize("over, n", [
    ({"mesh.expert": 2, "mesh.fsdp": 2}, 4),
    ({"mesh.expert": 2, "mesh.fsdp": 2, "mesh.tensor": 2}, 8),
    ({"mesh.expert": 4, "mesh.data": 2}, 8),
], ids=["expert2-fsdp2", "expert2-fsdp2-tensor2", "expert4-data2"])
def test_state_per_device_equals_the_built_model_shards(over, n, devices8):
    cfg = _moe(**over)
    mesh = build_mesh(cfg.mesh, devices8[:n])
    _, state, shardings = abstract_train_state(cfg, mesh, make_optimizer(cfg))
    deg = dict(mesh.shape)
    split = param_split(cfg, deg)
    on_device = _elements_per_device(state.weights, shardings.weights)
    assert split.total == on_device == _by_hand(deg["expert"], deg["fsdp"], deg["tensor"])
    layers = _elements_per_device(state.weights["layers"], shardings.weights["layers"])
    assert split.layers == layers
    # AdamW's two moments mirror the parameters' shards (the memory model's 'optimizer')
    moments = [(x, s) for x, s in zip(jax.tree.leaves(state.opt_state),
                                      jax.tree.leaves(shardings.opt_state), strict=True)
               if x.ndim]
    assert sum(math.prod(s.shard_shape(x.shape)) for x, s in moments) == 2 * on_device


def test_memory_rows_by_hand_expert2_fsdp2():
    """float32 master weights, AdamW, grad_accum 1: 4 + 8 + 4 bytes per parameter on the
    device, the experts split 4 ways (expert x fsdp), not 2 as a uniform split would."""
    cfg = _moe(**{"mesh.expert": 2, "mesh.fsdp": 2, "mesh.data": 2})
    mem = _estimate(cfg).memory
    per_device = _by_hand(ep=2, fsdp=2)
    assert per_device == 10_560
    assert mem["weights"] == 4 * per_device
    assert mem["optimizer"] == 8 * per_device
    assert mem["gradients"] == 4 * per_device
    # (a uniform split of all 27,072 parameters over fsdp would hold 13,536 on the device)
    assert param_counts(cfg)[0] / 2 == 13_536
    # the rows split over expert x data x fsdp: 16 x 16 tokens over 8 devices, 32 a device;
    # full remat keeps each layer's [32, D] input in bf16
    full = _estimate(_moe(**{"mesh.expert": 2, "mesh.fsdp": 2, "mesh.data": 2,
                             "execution.remat": "full"}))
    assert full.memory["saved_activations"] == L * 32 * D * 2


def test_moe_transient_is_near_the_compiled_peak():
    """The MoE layer's transient (models/common/moe_plan.py layer_transient_bytes) against what XLA compiled
    for a 2-layer Qwen3-30B-A3B step on 1 x 8 H100 at grad_accum 1 (`python -m launch.plan
    --config configs/qwen3_30b_a3b.py --gpu h100 --nodes 1 --set model.n_layers=2 --buffers
    40`, deviceless: temporaries 92.0 GB, six [2,097,152, 2048] bf16 buffers of dispatched
    rows at 8.6 GB each the largest). The formula without the [rows, d_model] buffers gave
    26.1 GB."""
    from tests.helpers.small import ROOT
    from titanax.config import apply_overrides, load_config

    cfg = apply_overrides(load_config(ROOT / "configs" / "qwen3_30b_a3b.py"),
                          {"model.n_layers": 2})
    transient = _estimate(cfg).memory["transient"]
    assert 0.85 * 92.0e9 < transient < 1.1 * 92.0e9, transient / 1e9


def _a2a(ep: int, C: int, act: int, rows: int, ids: int) -> float:
    """Bytes one device sends per step: (ep - 1)/ep of each [ep, C, D] buffer and int32 [ep, C]
    one, L layers, one microbatch."""
    return L * (ep - 1) / ep * (rows * ep * C * D * act + ids * ep * C * 4)


@pytest.mark.parametrize("remat, rows, ids", [("none", 4, 1), ("full", 6, 2)])
@pytest.mark.parametrize("factor, capacity", [(0.0, 64), (1.25, 40), (0.5, 16)])
def test_all_to_all_bytes_by_hand(remat, rows, ids, factor, capacity):
    """expert 2 x fsdp 4: 16 rows of 16 over 8 devices = T 32 tokens, T K = 64 pairs; dropless
    C = 64 (every pair to one rank), factor f: ceil(f x 64 / 2). Forward two row buffers and
    the ids, backward two, full remat the forward's three again; bf16 rows."""
    cfg = _moe(**{"mesh.expert": 2, "mesh.fsdp": 4, "execution.remat": remat,
                  "execution.expert_capacity_factor": factor})
    est = _estimate(cfg)
    c = est.comm["expert"]
    assert c.bytes_per_step == _a2a(2, capacity, 2, rows, ids)
    assert c.calls == L * (rows + ids)
    assert (c.link, c.degree, c.overlapped) == ("nvlink", 2, False)
    assert c.seconds == pytest.approx(c.bytes_per_step / c.bus_bandwidth
                                      + c.calls * EFFICIENCIES.nvlink_latency_s)
    assert est.memory["expert_buffers"] == 2 * 2 * capacity * D * 2  # send and receive
    assert est.breakdown_s["exposed_comm"] >= c.seconds


def test_all_to_all_with_four_expert_ranks_sends_three_quarters():
    cfg = _moe(**{"mesh.expert": 4, "mesh.fsdp": 2, "execution.expert_capacity_factor": 1.0})
    # T = 32 tokens, 64 pairs, C = ceil(64 / 4) = 16
    assert _estimate(cfg).comm["expert"].bytes_per_step == _a2a(4, 16, 2, 4, 1)


def test_expert_axis_link_is_nvlink_inside_a_domain_and_infiniband_across():
    """parallel/mesh.py puts expert right after tensor inside a domain: tensor 2 x expert 4
    fits in 8 GPUs (NVLink); tensor 2 x expert 8 on two nodes does not (InfiniBand, the
    axis' 4 GPUs of a domain each on its rail), as any ring over the axis."""
    two = Cluster("h100", 2)
    for ep, link in ((4, "nvlink"), (8, "infiniband")):
        cfg = plan_config(tiny_config(**{**MOE, "model.n_experts": 8, "mesh.tensor": 2,
                                         "mesh.expert": ep, "mesh.fsdp": -1}), two)
        layout = layout_for(cfg, two)
        c = estimate(cfg, two, layout).comm["expert"]
        assert c.link == link
        assert (c.link, c.bus_bandwidth) == Network(layout, two, EFFICIENCIES) \
            .bus_bandwidth("expert")[:2]


def test_gradients_of_replicated_weights_are_summed_over_expert_ranks():
    """Outside the experts an expert rank is a data-parallel one: every gradient but the
    experts' is all-reduced over expert x data (2 (n-1)/n of it, bf16); the experts' over data
    alone (data 1 here: nothing)."""
    cfg = _moe(**{"mesh.expert": 2, "mesh.fsdp": 4})
    c = _estimate(cfg).comm["data"]
    replicated = _by_hand(ep=2, fsdp=4) - 3 * L * E * D * F / 8
    assert c.over == ("expert", "data") and c.degree == 2
    assert c.bytes_per_step == 2 * (2 - 1) / 2 * replicated * 2


def test_gemm_time_counts_the_active_experts():
    cfg = _moe(**{"mesh.expert": 2, "mesh.fsdp": 4})
    est = _estimate(cfg)
    active = est.params_no_embed - L * (E - K) * 3 * D * F  # ModelSpec.flops' N
    gemm_flops = 2 * (active - D * V) * est.tokens_per_step * 3 + 2 * 3 * D * V \
        * est.tokens_per_step  # remat none: 3 passes; the output layer's 3
    hw = H100.hardware
    assert est.breakdown_s["gemm"] == pytest.approx(
        gemm_flops / 8 / (hw.bf16_flops * EFFICIENCIES.gemm))


def test_plan_says_what_dropless_costs_and_how_to_bound_it():
    plan = make_plan(_moe(**{"mesh.expert": 2, "mesh.fsdp": 4}), H100, compile_step=False)
    ep = plan["expert_parallel"]
    assert (ep["tokens_per_device"], ep["pairs_per_device"], ep["rows_per_destination"]) == \
        (32, 64, 64)
    text = format_plan(plan)
    assert "expert   x2   nvlink" in text and "expert all-to-alls:" in text
    assert "dropless" in text and "--set execution.expert_capacity_factor=1.25" in text
    bounded = make_plan(_moe(**{"mesh.expert": 2, "mesh.fsdp": 4,
                                "execution.expert_capacity_factor": 1.25}), H100,
                        compile_step=False)
    assert "advice" not in bounded["expert_parallel"]
    assert "capacity factor 1.25" in format_plan(bounded)
    assert "expert_parallel" not in make_plan(_moe(**{"mesh.fsdp": 8}), H100,
                                              compile_step=False)


def test_expert_on_a_dense_model_is_refused_in_one_line():
    with pytest.raises((PlanError, ConfigError), match="mesh.expert.*set mesh.expert=1"):
        make_plan(tiny_config(**{"mesh.expert": 2, "mesh.fsdp": 4}), H100,
                  compile_step=False)


def test_search_tries_expert_degrees_for_moe_only():
    moe = plan_config(_moe(), H100)
    degrees = {o["mesh.expert"] for _, o in candidates(moe, H100, max_context=1)}
    assert degrees == {1, 2, 4}  # the divisors of 4 experts (8 does not divide them)
    assert not [lab for lab, o in candidates(moe, H100) if o["execution.tp_overlap"]]
    kept, _ = search(moe, H100, max_context=1)
    assert [c for c in kept if c.cfg.mesh.expert > 1 and "expert=" in c.label]
    dense = plan_config(tiny_config(), H100)
    assert {o["mesh.expert"] for _, o in candidates(dense, H100, max_context=1)} == {1}
