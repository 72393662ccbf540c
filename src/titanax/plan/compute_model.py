"""Compute time of one train step per device: GEMMs, attention and elementwise HBM traffic,
each at its own achievable fraction of the datasheet (cost_model.Efficiencies).

Context parallelism changes no total: a device holds S/context tokens of its rows, and its
attention (S/context queries against the keys before them, in load-balanced chunks from both
ends of the sequence) is 1/context of the rows' causal attention, the same on every device.

What the run trains says how many of the base's weight gradients the backward computes
(plan/training.py weight_gradients). LoRA differentiates the adapters alone: the backward
computes the activations' gradients through the frozen base but no base weight gradient, so
the base's matmuls run one forward's worth fewer (4 N instead of 6 N per token without remat;
the output layer's too), while the adapters' own matmuls (2 x their parameters per token and
forward) run every pass. Those are rank-r products, far below the GEMM roofline: they are
counted as HBM traffic (each adapter reads its input and adds to its output per pass,
elementwise_seconds; plan/lora.py), not at GEMM rate. MFU stays the model's 6 N + 12 L d S
(docs/planner.md).

The architecture says which parameters a token runs through and what its feed-forward moves
besides its GEMMs (models/spec.py PlannerTerms): a mixture of experts the K experts a token is
routed to (as ModelSpec.flops counts them), at the dense GEMM efficiency with the routing
balanced, and its dispatch's copies."""

from __future__ import annotations

from pallas_kernels.fp8.backends import RECIPES as FP8_RECIPES
from titanax.config import Config
from titanax.config.parallel import batch_ways
from titanax.plan.cluster import Cluster
from titanax.plan.documents import attention_share
from titanax.plan.efficiencies import Efficiencies
from titanax.plan.state_shape import plan_state
from titanax.plan.step_shape import StepShape

# Forward passes (in units of one forward) each remat policy runs per step: the backward is
# two forwards' worth of matmuls; full remat recomputes the forward once more.
GEMM_PASSES = {"full": 4.0, "full_offload": 4.0, "dots": 3.0, "dots_no_batch": 3.0,
               "none": 3.0}
# Attention is not a dot to the remat policies: it is recomputed under every policy but none.
ATTN_PASSES = {"full": 4.0, "full_offload": 4.0, "dots": 4.0, "dots_no_batch": 4.0,
               "none": 3.0}
# Pipelined layers are checkpointed per tick (gpipe, circular) or recomputed per microbatch
# (1f1b): the backward runs the layers' forward once more, and a layer under full remat then
# recomputes itself a third time inside its own backward. Attention is recomputed by every
# policy but none.
PIPELINE_GEMM_PASSES = {"full": 5.0, "full_offload": 5.0, "dots": 4.0, "dots_no_batch": 4.0,
                        "none": 4.0}
PIPELINE_ATTN_PASSES = {"full": 5.0, "full_offload": 5.0, "dots": 5.0, "dots_no_batch": 5.0,
                        "none": 4.0}


def _gemm_passes(cfg: Config, shape: StepShape) -> float:
    return (PIPELINE_GEMM_PASSES if shape.deg["pipeline"] > 1 else GEMM_PASSES)[cfg.execution.remat]


def gemm_seconds(cfg: Config, shape: StepShape, cluster: Cluster, n_no_embed: int,
                 eff: Efficiencies) -> float:
    m, hw, pp, tokens = cfg.model, cluster.hardware, shape.deg["pipeline"], shape.tokens
    d, V = m.d_model, m.vocab_size
    peak = hw.fp8_flops if cfg.execution.matmul_precision in FP8_RECIPES else hw.bf16_flops
    # The decoder layers' matmuls run the policy's forwards' worth (one forward: 2 FLOPs per
    # parameter and token); the output layer is not rematerialised: 3 forwards' worth. LoRA
    # computes no weight gradient for either: one forward's worth less (module docstring).
    state = plan_state(cfg)
    frozen = 1.0 - state.training.weight_gradients
    # (A mixture of experts: the experts a token is routed to, models/common/moe_plan.py.)
    active = state.terms.active_params(cfg, n_no_embed)
    layer_flops = 2.0 * (active - d * V) * tokens * (_gemm_passes(cfg, shape) - frozen)
    output_flops = 2.0 * (3.0 - frozen) * d * V * tokens
    # The output layer and loss run once per microbatch, spread over the pipeline stages
    # (gpipe and circular with microbatches divisible by the stages); otherwise one stage
    # (1f1b: the last) or every stage runs it for all of them, and the others wait: pp-1
    # extra copies of its FLOPs on the critical path, never FP8.
    spread = pp == 1 or (cfg.pipeline.schedule != "1f1b" and shape.micro % pp == 0)
    redundant_output = 0.0 if spread else \
        (pp - 1) * output_flops / cluster.n_gpus / (hw.bf16_flops * eff.gemm)
    return ((layer_flops + output_flops) / cluster.n_gpus / (peak * eff.gemm)
            + redundant_output)


def attention_passes(cfg: Config, shape: StepShape) -> float:
    """Attention's passes per step in units of one forward (the backward counts two)."""
    return (PIPELINE_ATTN_PASSES if shape.deg["pipeline"] > 1 else ATTN_PASSES)[cfg.execution.remat]


def attention_seconds(cfg: Config, shape: StepShape, cluster: Cluster,
                      eff: Efficiencies) -> float:
    m, hw = cfg.model, cluster.hardware
    attn_model_flops = 12.0 * m.n_layers * m.d_model * cfg.train.seq_len * shape.tokens
    # The share of the full S x S scores the kernels compute (causal: half; packed documents:
    # less, documents.py); at bf16 rate. Context parallelism's balanced chunks give every
    # device 1/n_gpus of the total as well.
    share = attention_share(cfg, shape.doc_tokens)
    return (attn_model_flops * share * attention_passes(cfg, shape) / 3 / cluster.n_gpus
            / (hw.bf16_flops * eff.attention))


def elementwise_seconds(cfg: Config, shape: StepShape, cluster: Cluster,
                        eff: Efficiencies) -> float:
    m, hw, deg = cfg.model, cluster.hardware, shape.deg
    # Elementwise traffic per token and layer, one forward: two RMSNorms, RoPE on q and k,
    # SwiGLU and two residual adds read/write ~ 12 d + 3 f values (an MoE: SwiGLU per routed
    # expert and the dispatch's copies, models/common/moe_plan.py), and any adapters' traffic.
    state = plan_state(cfg)
    fwd_bytes = ((12 * m.d_model + state.terms.ffn_elementwise_values(cfg)
                  + state.training.adapter_values_per_token(cfg))
                 * shape.act_bytes * m.n_layers * shape.tokens
                 / (batch_ways(deg) * shape.context * deg["tensor"] * deg["pipeline"]))
    return fwd_bytes * _gemm_passes(cfg, shape) / (hw.hbm_bandwidth * eff.hbm)
