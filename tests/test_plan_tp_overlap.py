"""The planner with tensor-parallel overlap (execution.tp_overlap, parallel/collective_matmul.py):
without it the tensor collectives are XLA's whole all-gathers and whole-sequence all-reduces
(twice a reduce-scatter's bytes), all exposed; with it each is tp-1 ring sends over NVLink,
each beside a GEMM step hiding min(1, n BW / R) of it (twice that in the backward), one send
per collective never hidden; FP8 recipes and 1f1b get none; the search turns it on. Cost model
only: no compiles."""

import dataclasses

import pytest

from pallas_kernels import aot
from titanax.config import ConfigError, load_config
from titanax.plan import Cluster
from titanax.plan import search as plan_search
from titanax.plan.cluster import layout_for, plan_config
from titanax.plan.comm_model import (
    Network,
    tensor_comm,
    tp_hidden_share,
    tp_layer_collectives,
    tp_overlap_applies,
)
from titanax.plan.cost_model import EFFICIENCIES, estimate
from titanax.plan.planner import overrides_for
from titanax.plan.step_shape import StepShape

H100 = Cluster("h100", 1)
R = 989e12 * EFFICIENCIES.gemm  # achieved bf16 GEMM FLOP/s
BW = 450e9 * EFFICIENCIES.nvlink  # point-to-point NVLink bytes/s
LAT = EFFICIENCIES.nvlink_latency_s
# Llama-3-8B: d 4096, 32 heads, 8 kv heads of 128, ffn 14336, 32 layers; 8 GPUs as tensor 4 x
# fsdp 2, 8 sequences of 8192: 4 per fsdp shard, 32768 tokens of residual stream
BASE = ("train.grad_accum=1", "train.batch_size=8", "mesh.tensor=4", "mesh.fsdp=2", "mesh.data=1",
        "execution.remat=full")
TOKENS, D, TP, LAYERS = 4 * 8192, 4096, 4, 32


def _8b(*overrides):
    return plan_config(load_config(aot.REPO / "configs/llama3_8b.py",
                                   ["execution.attention_impl=auto", *BASE, *overrides]), H100)


def _tensor(cfg):
    layout = layout_for(cfg, H100)
    return tensor_comm(cfg, StepShape.of(cfg, layout.degrees), Network(layout, H100,
                                                                       EFFICIENCIES))


def test_without_overlap_the_row_side_is_a_whole_sequence_all_reduce():
    unit = 3 / 4 * TOKENS * D * 2  # an all-gather of the sequence: (tp-1)/tp of it, bf16
    # no remat: forward and backward gather twice and all-reduce twice per layer
    c = _tensor(_8b("execution.remat=none"))
    assert c.bytes_per_step == pytest.approx(LAYERS * (4 + 2 * 4) * unit)
    # full remat adds the recompute: two gathers, one all-reduce (w_down's is not redone)
    c = _tensor(_8b())
    assert c.bytes_per_step == pytest.approx(LAYERS * (6 + 2 * 5) * unit)
    assert c.calls == LAYERS * 11 and c.hidden_s == 0
    assert c.seconds == pytest.approx(c.bytes_per_step / BW + c.calls * LAT)


def test_hidden_share_per_formula():
    # n BW / R per ring step in the forward, twice that in the backward, at most 1
    assert tp_hidden_share(1024, False, 2, R, BW) == pytest.approx(1024 * BW / R)
    assert tp_hidden_share(1024, True, 2, R, BW) == pytest.approx(2 * 1024 * BW / R)
    assert tp_hidden_share(1e6, True, 2, R, BW) == 1.0
    widths = {c.matmul: c.width for c in tp_layer_collectives(_8b(), StepShape.of(
        _8b(), {"pipeline": 1, "data": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 4}))}
    assert widths == {"qkv": (32 + 2 * 8) * 128 / 4, "wo": 32 * 128 / 4,
                      "gate_up": 2 * 14336 / 4, "w_down": 14336 / 4}


def test_overlap_hides_per_formula_and_exposes_less():
    off, on = _tensor(_8b()), _tensor(_8b("execution.tp_overlap=true"))
    # ring sends: every collective moves (tp-1)/tp of the sequence, no all-reduce doubling
    step = TOKENS / TP * D * 2 / BW  # one [M, d] chunk over NVLink
    assert on.bytes_per_step == pytest.approx(LAYERS * 11 * 3 * step * BW)
    assert on.calls == LAYERS * 11 * 3
    assert on.seconds == pytest.approx(on.calls * (step + LAT))

    def h(n, backward=False):
        return min(1.0, (2 if backward else 1) * n * BW / R)
    qkv, wo, gate_up, w_down = 1536, 1024, 7168, 3584
    forward = h(qkv) + h(wo) + h(gate_up) + h(w_down)
    recompute = h(qkv) + h(wo) + h(gate_up)
    backward = sum(h(n, True) for n in (qkv, wo, gate_up, w_down))
    # of each collective's tp-1 = 3 sends, one is never hidden
    want = LAYERS * (forward + recompute + backward) * 2 * step
    assert on.hidden_s == pytest.approx(want)
    assert 0 < h(wo) < h(qkv) < 1  # the 8B's narrow projections do not hide all of it
    assert on.exposed_s < off.exposed_s
    est_off = estimate(_8b(), H100, layout_for(_8b(), H100))
    est_on = estimate(_8b("execution.tp_overlap=true"), H100,
                      layout_for(_8b("execution.tp_overlap=true"), H100))
    assert est_on.breakdown_s["exposed_comm"] == pytest.approx(on.exposed_s)
    assert est_on.tokens_per_s_per_gpu > est_off.tokens_per_s_per_gpu


def test_fp8_and_1f1b_get_no_overlap():
    # the config refuses them (config.tp_overlap_unsupported) ...
    with pytest.raises(ConfigError, match="execution.tp_overlap"):
        _8b("execution.tp_overlap=true", "execution.matmul_precision=fp8_tensorwise")
    # ... and the model counts none where it meets them anyway (mesh degrees given apart
    # from the config, as the search's estimates see them)
    plain = _8b("mesh.tensor=1", "mesh.fsdp=8", "execution.tp_overlap=true")
    fp8 = dataclasses.replace(plain, model=dataclasses.replace(
        plain.model, matmul_precision="fp8_tensorwise"))
    deg = {"pipeline": 1, "data": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 4}
    assert tp_overlap_applies(plain, StepShape.of(plain, deg))
    assert not tp_overlap_applies(fp8, StepShape.of(fp8, deg))
    onef1b = _8b("mesh.tensor=1", "mesh.fsdp=4", "mesh.pipeline=2", "pipeline.schedule=1f1b",
                 "pipeline.microbatches=2")
    onef1b = dataclasses.replace(onef1b, model=dataclasses.replace(onef1b.model,
                                                                   tp_overlap=True))
    assert not tp_overlap_applies(onef1b, StepShape.of(onef1b, {**deg, "pipeline": 2,
                                                                "fsdp": 1}))
    assert not tp_overlap_applies(plain, StepShape.of(plain, {**deg, "tensor": 1, "fsdp": 8}))


def test_search_turns_overlap_on_where_the_config_takes_it():
    cfg = load_config(aot.REPO / "configs/llama3_8b.py", ["train.batch_size=8"])
    seen = {}
    for label, o in plan_search.candidates(cfg, Cluster("h100", 2), max_context=1):
        want = o["mesh.tensor"] > 1 and not (o["mesh.pipeline"] > 1
                                             and o["pipeline.schedule"] == "1f1b")
        assert o["execution.tp_overlap"] is want, label
        assert ("tp_overlap" in label) is want
        seen[want] = seen.get(want, 0) + 1
    assert seen[True] and seen[False]
    fp8 = load_config(aot.REPO / "configs/llama3_8b.py",
                      ["train.batch_size=8", "execution.matmul_precision=fp8_tensorwise"])
    assert not any(o["execution.tp_overlap"] for _, o in
                   plan_search.candidates(fp8, Cluster("h100", 1), max_context=1))
    assert "execution.tp_overlap=True" in overrides_for(_8b("execution.tp_overlap=true"))
    assert not any(f.startswith("execution.tp_overlap") for f in overrides_for(
        _8b("mesh.tensor=1", "mesh.fsdp=8")))
