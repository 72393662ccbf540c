"""Analytic model of one train step on a cluster: memory per device, FLOPs, communication
bytes per mesh axis, and a predicted step time, tokens/s per GPU and MFU. `estimate` composes
memory_model.py (bytes per device), compute_model.py (GEMM, attention, elementwise time) and
comm_model.py (one function per mesh axis, plus the host link).

Constants come from datasheets (hardware.py) and from widely reported achievable
efficiencies, never fitted to the published training throughputs that docs/planner.md puts
beside the predictions. Each is a named field of `Efficiencies` (efficiencies.py) with where
it comes from.

Step time, per device (everything below is per GPU):
    compute   = GEMM FLOPs / (peak x gemm) + attention FLOPs / (peak x attention)
                + elementwise HBM bytes / (HBM bandwidth x hbm)
    stage     = compute + tensor-parallel comm (less what the collective matmul's GEMM steps
                hide) + pipeline send/recv                                (on the critical path)
                + the context ring's sends beyond the attention they overlap (or its
                all-gathers, exposed)
    pipelined = stage / (1 - bubble),  bubble = (p - 1) / (m + p - 1) / v
    step      = max(pipelined, FSDP + data-parallel comm) + optimizer update
FSDP all-gathers / reduce-scatters and the data-parallel gradient all-reduce are asynchronous
in XLA's GPU schedule and overlap the layers' compute; tensor-parallel collectives sit between
dependent matmuls and are exposed, but for the share the GEMM steps beside them hide when
execution.tp_overlap runs them as a collective matmul (comm_model.tensor_comm).

Counts come from the abstract state (plan/state_shape.py), and each model counts what the
run trains (plan/training.py; LoRA, docs/lora.md: the frozen base without gradients or
optimizer state, no base weight gradients computed or reduced, the update over the adapters
alone). flops_per_token and mfu stay the model's formula (6 N + 12 L d S), the figure
launch.train logs; `lora_flops_per_token` is what a LoRA step itself computes
(plan/lora.py AdapterTraining.step_flops_per_token; 0 without) and `lora_mfu` the
utilisation by it.
"""

from __future__ import annotations

import dataclasses

from titanax.config import Config
from titanax.plan.cluster import Cluster, Layout
from titanax.plan.comm_model import AxisComm, Network, axis_comms, host_link_seconds
from titanax.plan.compute_model import attention_seconds, elementwise_seconds, gemm_seconds
from titanax.plan.documents import mean_document_tokens
from titanax.plan.efficiencies import EFFICIENCIES, Efficiencies
from titanax.plan.memory_model import memory_per_device, param_split
from titanax.plan.state_shape import plan_state
from titanax.plan.step_shape import StepShape


@dataclasses.dataclass
class Estimate:
    params: int
    params_no_embed: int
    tokens_per_step: int
    flops_per_token: float
    flops_per_step: float
    memory: dict[str, float]  # bytes per device by component, plus 'total'
    host_memory: dict[str, float]  # pinned host bytes per device (offload options), 'total'
    usable_memory_bytes: float
    fits: bool
    comm: dict[str, AxisComm]
    compute_s: float
    bubble: float
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    breakdown_s: dict[str, float]
    host_offload_cost_s: float = 0.0  # step_s minus the same step with nothing offloaded
    adapter_params: int = 0  # LoRA: the adapters' parameters (0 without LoRA)
    lora_flops_per_token: float = 0.0  # LoRA: 4 N + 6 N_adapters + 12 L d S (0 without)
    lora_mfu: float = 0.0  # LoRA: the utilisation by lora_flops_per_token


def param_counts(cfg: Config) -> tuple[int, int]:
    """(all parameters, parameters without the input embedding), exact, from the abstract
    state."""
    state = plan_state(cfg)
    return state.n_params, state.n_no_embed


def estimate(cfg: Config, cluster: Cluster, layout: Layout,
             eff: Efficiencies = EFFICIENCIES, doc_tokens: float | None = None) -> Estimate:
    """doc_tokens: mean tokens per packed document (plan/documents.py); None: read from the
    config's shard folders, if it masks documents and they say."""
    if cfg.train.grad_accum_auto:  # never planned silently at 1 (planner.evaluate_auto)
        raise ValueError("estimate: train.grad_accum=auto is a choice to make first "
                         "(titanax.plan.planner.evaluate_auto, or plan.model_fit)")
    hw = cluster.hardware
    if doc_tokens is None:
        doc_tokens = mean_document_tokens(cfg)
    shape = StepShape.of(cfg, layout.degrees, doc_tokens)
    pp, tokens = shape.deg["pipeline"], shape.tokens
    state = plan_state(cfg)
    n_params, n_no_embed, training = state.n_params, state.n_no_embed, state.training
    fpt = state.spec.flops(cfg.model, cfg.train.seq_len, n_no_embed)

    memory, host_memory = memory_per_device(cfg, shape.deg)
    usable = hw.hbm_bytes * eff.usable_memory

    gemm_s = gemm_seconds(cfg, shape, cluster, n_no_embed, eff)
    attn_s = attention_seconds(cfg, shape, cluster, eff)
    elem_s = elementwise_seconds(cfg, shape, cluster, eff)
    compute_s = gemm_s + attn_s + elem_s

    comm = axis_comms(cfg, shape, Network(layout, cluster, eff))
    host_hidden, host_exposed = host_link_seconds(cfg, shape, host_memory, cluster, eff)

    exposed = sum(c.exposed_s for c in comm.values())
    comm_hidden = sum(c.seconds for c in comm.values() if c.overlapped)
    hidden = max(comm_hidden, host_hidden)
    bubble = (pp - 1) / (shape.micro + pp - 1) / shape.virtual if pp > 1 else 0.0
    pipelined = (compute_s + exposed) / (1 - bubble)
    # AdamW update: read weights, gradient and two moments, write three (fp32), memory bound;
    # over what the run trains (LoRA: its adapters alone).
    local_params = training.optimized_per_device(shape.deg, param_split(cfg, shape.deg))
    optimizer_s = local_params * (4 * 4 + 3 * 4) / (hw.hbm_bandwidth * eff.hbm)
    step_s = max(pipelined, hidden) + optimizer_s + host_exposed
    tps = tokens / step_s / cluster.n_gpus
    lora_fpt = training.step_flops_per_token(cfg, n_no_embed)
    return Estimate(
        params=n_params, params_no_embed=n_no_embed, tokens_per_step=tokens,
        flops_per_token=fpt, flops_per_step=fpt * tokens, memory=memory,
        host_memory=host_memory, usable_memory_bytes=usable, fits=memory["total"] <= usable,
        comm=comm, compute_s=compute_s, bubble=bubble, step_s=step_s,
        tokens_per_s_per_gpu=tps, mfu=tps * fpt / hw.bf16_flops,
        # the update's copies after the backward, and whatever of the copies under the
        # layers outlasts their compute and collectives
        host_offload_cost_s=host_exposed + max(pipelined, hidden) - max(pipelined, comm_hidden),
        breakdown_s={"gemm": gemm_s, "attention": attn_s, "elementwise": elem_s,
                     "exposed_comm": exposed, "overlapped_comm": hidden,
                     "comm_hidden_in_layers": sum(c.hidden_s for c in comm.values()),
                     "bubble": pipelined - compute_s - exposed, "optimizer": optimizer_s,
                     "host_offload_exposed": host_exposed, "host_offload_overlapped": host_hidden},
        adapter_params=training.adapter_params, lora_flops_per_token=lora_fpt,
        lora_mfu=tps * lora_fpt / hw.bf16_flops)
