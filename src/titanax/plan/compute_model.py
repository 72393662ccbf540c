"""Compute time of one train step per device: GEMMs, attention and elementwise HBM traffic,
each at its own achievable fraction of the datasheet (cost_model.Efficiencies).

Context parallelism changes no total: a device holds S/context tokens of its rows, and its
attention (S/context queries against the keys before them, in load-balanced chunks from both
ends of the sequence) is 1/context of the rows' causal attention, the same on every device."""

from __future__ import annotations

from pallas_kernels.fp8.backends import RECIPES as FP8_RECIPES
from titanax.config import Config
from titanax.plan.cluster import Cluster
from titanax.plan.documents import attention_share
from titanax.plan.efficiencies import Efficiencies
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
    # The decoder layers' matmuls are rematerialised per the policy; the output layer is not.
    output_flops = 6.0 * d * V * tokens
    layer_gemm_flops = 6.0 * n_no_embed * tokens - output_flops
    # The output layer and loss run once per microbatch, spread over the pipeline stages
    # (gpipe and circular with microbatches divisible by the stages); otherwise one stage
    # (1f1b: the last) or every stage runs it for all of them, and the others wait: pp-1
    # extra copies of its 6 d V FLOPs per token on the critical path, never FP8.
    spread = pp == 1 or (cfg.pipeline.schedule != "1f1b" and shape.micro % pp == 0)
    redundant_output = 0.0 if spread else \
        (pp - 1) * 6.0 * d * V * tokens / cluster.n_gpus / (hw.bf16_flops * eff.gemm)
    return ((layer_gemm_flops * _gemm_passes(cfg, shape) / 3 + output_flops) / cluster.n_gpus
            / (peak * eff.gemm) + redundant_output)


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
    # SwiGLU and two residual adds read/write ~ 12 d + 3 f values.
    fwd_bytes = ((12 * m.d_model + 3 * m.ffn_dim) * shape.act_bytes * m.n_layers * shape.tokens
                 / (deg["data"] * deg["fsdp"] * shape.context * deg["tensor"] * deg["pipeline"]))
    return fwd_bytes * _gemm_passes(cfg, shape) / (hw.hbm_bandwidth * eff.hbm)
