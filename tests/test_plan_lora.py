"""The planner for LoRA (issue 35, docs/lora.md, docs/planner.md): the adapter count and its
per-device share equal the built model's adapters and their shardings; the memory model holds
the frozen base in its dtype with no gradient or moments for it, and the adapters' state by
hand; LoRA plans below full fine-tuning in memory, FSDP traffic and step time; the search
generates none of the settings the config refuses with LoRA. Cost model only (no compile)."""

import math

import jax
import pytest

from tests.helpers.layouts import tiny_config
from titanax.config import load_config
from titanax.parallel.mesh import build_mesh
from titanax.plan import Cluster, make_plan
from titanax.plan.cluster import layout_for, plan_config
from titanax.plan.cost_model import estimate
from titanax.plan.lora import projection_widths
from titanax.plan.report import format_plan
from titanax.plan.search import candidates
from titanax.plan.state_shape import plan_state
from titanax.train.optim import make_optimizer
from titanax.train.state import abstract_train_state

pytestmark = pytest.mark.usefixtures("devices8")  # the sharded layouts' meshes

N_70B = 70_553_706_496
# Llama-3-70B, rank 16, all seven projections, per layer: the factors on d_model (A of
# wq, wk, wv, w_gate, w_up; B of wo, w_down) and those on the heads / mlp side
EMBED_SIDE = 16 * 7 * 8192
OTHER_SIDE = 16 * (8192 + 1024 + 1024 + 8192 + 3 * 28672)

# tiny llama3 (GQA: 4 heads, 2 kv heads) on fsdp x tensor; qwen3 with one kv head and a
# head_dim that is not d_model / n_heads, three targets, on fsdp alone
LLAMA = {"lora.rank": 4, "mesh.fsdp": 4, "mesh.tensor": 2, "mesh.data": 1}
QWEN = {"model.arch": "qwen3", "model.n_kv_heads": 1, "model.head_dim": 16, "lora.rank": 3,
        "lora.targets": "q,v,down", "model.n_layers": 3, "mesh.fsdp": 8, "mesh.data": 1}


def _70b(*overrides):
    return load_config("configs/llama3_70b.py", ["train.grad_accum=1", *overrides])


def _estimate(cfg, cluster):
    cfg = plan_config(cfg, cluster)
    return estimate(cfg, cluster, layout_for(cfg, cluster))


def _elements_per_device(tree, shardings) -> int:
    return sum(math.prod(s.shard_shape(x.shape)) for x, s in
               zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True))


@pytest.mark.parametrize("over", [LLAMA, QWEN], ids=["llama3-gqa", "qwen3-one-kv-head"])
def test_adapter_count_and_share_equal_the_built_adapters(over, devices8):
    cfg = tiny_config(**over)
    mesh = build_mesh(cfg.mesh, devices8)
    _, state, shardings = abstract_train_state(cfg, mesh, make_optimizer(cfg))
    built = sum(math.prod(x.shape) for x in jax.tree.leaves(state.adapters))
    # the planner's adapters (read from its abstract state by role) against the train
    # state's, and against rank x (in + out) per adapted projection and layer by hand
    adapters = plan_state(cfg).training.adapters
    widths = projection_widths(cfg.model)
    by_hand = sum(cfg.lora.rank * sum(widths[w]) for w in cfg.lora.weights)
    assert plan_state(cfg).training.adapter_params == built == cfg.model.n_layers * by_hand
    assert built == cfg.model.n_layers * adapters.per_layer
    # what one device holds: each factor sharded by its own axes (parallel/rules.py)
    deg = dict(mesh.shape)
    on_device = _elements_per_device(state.adapters, shardings.adapters)
    assert adapters.per_device(deg) == on_device
    # the optimizer's state: AdamW's two float32 moments per adapter element, nothing else
    # of any size (the memory model's adapter_optimizer)
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert sum(math.prod(x.shape) for x in moments) == 2 * built
    assert all(x.dtype == jax.numpy.float32 for x in moments)


@pytest.mark.parametrize("dtype,pbytes", [("float32", 4), ("bfloat16", 2)])
def test_lora_memory_is_the_frozen_base_and_the_adapters_state(dtype, pbytes):
    cluster = Cluster("h100", 1)  # fsdp=8
    for accum, sums in ((1, 1), (16, 2)):  # grad_accum sums the adapters plainly: 2 buffers
        e = _estimate(_70b("lora.rank=16", f"model.param_dtype={dtype}",
                           f"train.grad_accum={accum}"), cluster)
        mem = e.memory
        assert not {"weights", "optimizer", "gradients", "accumulation"} & set(mem)
        assert e.host_memory["total"] == 0
        assert mem["base_weights"] == pytest.approx(N_70B * pbytes / 8)
        adapters = 80 * (EMBED_SIDE / 8 + OTHER_SIDE)  # the heads / mlp side whole per GPU
        assert mem["adapters"] == pytest.approx(4 * adapters)
        assert mem["adapter_optimizer"] == pytest.approx(8 * adapters)
        assert mem["adapter_gradients"] == pytest.approx(4 * sums * adapters)
        assert e.adapter_params == 80 * (EMBED_SIDE + OTHER_SIDE) == 207_093_760


def test_lora_plans_below_full_fine_tuning():
    cluster = Cluster("h100", 1)
    full = _estimate(_70b("train.grad_accum=16"), cluster)
    lora = _estimate(_70b("train.grad_accum=16", "lora.rank=16"), cluster)
    assert lora.memory["total"] < full.memory["total"] - 100e9
    assert lora.memory["saved_activations"] == full.memory["saved_activations"]
    # FSDP: the base still gathered twice in bf16 (4 bytes per parameter); only the adapters'
    # gradients reduced, where full fine-tuning reduces every bf16 gradient (2 more)
    assert lora.comm["fsdp"].bytes_per_step == pytest.approx(
        full.comm["fsdp"].bytes_per_step * 4 / 6, rel=0.01)
    # no base weight gradients: the GEMMs' 4 passes (full remat) become 3, the output
    # layer's 3 become 2; the adapters' matmuls are HBM traffic, the update theirs alone
    assert 2 / 3 < lora.breakdown_s["gemm"] / full.breakdown_s["gemm"] < 3 / 4
    assert lora.breakdown_s["elementwise"] > full.breakdown_s["elementwise"]
    # (143 M adapter elements per GPU against 8.8 G parameters)
    assert lora.breakdown_s["optimizer"] == pytest.approx(
        full.breakdown_s["optimizer"] * 80 * (EMBED_SIDE / 8 + OTHER_SIDE) / (N_70B / 8))
    assert lora.step_s < full.step_s
    # MFU stays the model formula's (what launch.train logs); the step's own FLOPs beside it
    assert lora.flops_per_token == full.flops_per_token
    assert lora.lora_flops_per_token < 0.75 * full.flops_per_token


def test_lora_plan_says_what_it_trains():
    plan = make_plan(_70b("lora.rank=16", "train.grad_accum=16"), Cluster("h100", 1),
                     compile_step=False)
    assert plan["fits"] and plan["lora"]["adapter_params"] == 207_093_760
    text = format_plan(plan)
    assert "LoRA: rank 16" in text and "base frozen in float32" in text
    assert "base weights 35.3 GB, adapters 0.6 GB, adapter optimizer 1.1 GB, adapter " \
           "gradients 1.1 GB" in text
    assert "LoRA step:" in text and "lora" not in make_plan(
        _70b("train.grad_accum=16"), Cluster("h100", 1), compile_step=False)


def test_search_does_not_generate_what_lora_refuses():
    cfg = plan_config(_70b("lora.rank=16"), Cluster("h100", 2))
    labels = [label for label, _ in candidates(cfg, Cluster("h100", 2))]
    assert labels and any("pipeline=2" in lab for lab in labels)
    assert not [lab for lab in labels if "offload=" in lab or "1f1b" in lab]
