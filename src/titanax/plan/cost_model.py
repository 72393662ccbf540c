"""Analytic model of one train step on a cluster: memory per device, FLOPs, communication
bytes per mesh axis, and a predicted step time, tokens/s per GPU and MFU.

Constants come from datasheets (perf/hardware.py) and from widely reported achievable
efficiencies, never fitted to the published training throughputs that docs/planner.md puts
beside the predictions. Each is a named field of `Efficiencies` with where it comes from.

Step time, per device (everything below is per GPU):
    compute   = GEMM FLOPs / (peak x gemm) + attention FLOPs / (peak x attention)
                + elementwise HBM bytes / (HBM bandwidth x hbm)
    stage     = compute + tensor-parallel comm + pipeline send/recv      (on the critical path)
    pipelined = stage / (1 - bubble),  bubble = (p - 1) / (m + p - 1) / v
    step      = max(pipelined, FSDP + data-parallel comm) + optimizer update
FSDP all-gathers / reduce-scatters and the data-parallel gradient all-reduce are asynchronous
in XLA's GPU schedule and overlap the layers' compute; tensor-parallel collectives sit between
dependent matmuls and are counted as exposed (no collective-matmul overlap).

Collective time over an axis of degree n (ring, as NCCL runs it): bytes moved per device
(all-gather / reduce-scatter (n-1)/n x S, all-reduce 2(n-1)/n x S) over the axis' bus
bandwidth: NVLink when the axis stays inside an NVLink domain; when it crosses domains the
ring's bottleneck is the InfiniBand hop, where the axis' n_inner GPUs of a domain each drive
their own rail: min(NVLink, n_inner x rail) (build_mesh keeps cross-domain rings rail-aligned).
Plus a fixed latency per collective call.
"""

from __future__ import annotations

import dataclasses
import functools

from titanax.config import Config, ModelConfig
from titanax.models.registry import model_spec
from titanax.plan.cluster import Cluster, Layout
from titanax.plan.memory_model import memory_per_device, param_split
from titanax.train.metrics import flops_per_token



@dataclasses.dataclass(frozen=True)
class Efficiencies:
    # Large bf16 GEMMs (cuBLAS/cuBLASLt, thousands wide as in a 70B layer) sustain about
    # 70-80% of the dense datasheet peak on H100 SXM; the datasheet assumes boost clocks the
    # power limit does not hold under full tensor-core load. Same fraction taken for Blackwell.
    gemm: float = 0.75
    # Fused causal flash attention (cuDNN, FlashAttention-3): forward ~60-75% of peak on H100
    # at head_dim 128, backward ~40-55%; 0.5 for forward + backward together.
    attention: float = 0.5
    # Elementwise kernels (norms, RoPE, SwiGLU, residual adds) stream HBM at ~80% of peak.
    hbm: float = 0.8
    # NCCL all-gather / reduce-scatter bus bandwidth: ~360 GB/s of 450 on 8x H100 NVLink, and
    # ~40 GB/s per 400 Gb/s NDR rail, i.e. ~80% of the link either way.
    nvlink: float = 0.8
    ib: float = 0.8
    # Copies between HBM and pinned host memory: ~50-55 GB/s of PCIe Gen5's 64 GB/s each way
    # (cudaMemcpyAsync from pinned memory, bandwidthTest), i.e. ~80% of the link.
    host: float = 0.8
    # Fixed cost per collective call (launch, synchronisation, ring setup): ~10 us inside a
    # node, ~25 us across InfiniBand (small-message NCCL latencies).
    nvlink_latency_s: float = 10e-6
    ib_latency_s: float = 25e-6
    # HBM the step may use: the rest goes to the CUDA context, cuBLAS/cuDNN workspaces and
    # NCCL buffers (a few GB), so a plan must leave ~5% free.
    usable_memory: float = 0.95

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not v > 0 or (f.name not in ("nvlink_latency_s", "ib_latency_s") and v > 1):
                raise ValueError(f"Efficiencies.{f.name} must lie in (0, 1], got {v}")


EFFICIENCIES = Efficiencies()

# Forward passes (in units of one forward) each remat policy runs per step: the backward is
# two forwards' worth of matmuls; full remat recomputes the forward once more.
_GEMM_PASSES = {"full": 4.0, "full_offload": 4.0, "dots": 3.0, "dots_no_batch": 3.0,
                "none": 3.0}
# Attention is not a dot to the remat policies: it is recomputed under every policy but none.
_ATTN_PASSES = {"full": 4.0, "full_offload": 4.0, "dots": 4.0, "dots_no_batch": 4.0,
                "none": 3.0}
# Pipelined layers are checkpointed per tick (gpipe, circular) or recomputed per microbatch
# (1f1b): the backward runs the layers' forward once more, and a layer under full remat then
# recomputes itself a third time inside its own backward. Attention is recomputed by every
# policy but none.
_PIPELINE_GEMM_PASSES = {"full": 5.0, "full_offload": 5.0, "dots": 4.0, "dots_no_batch": 4.0,
                         "none": 4.0}
_PIPELINE_ATTN_PASSES = {"full": 5.0, "full_offload": 5.0, "dots": 5.0, "dots_no_batch": 5.0,
                         "none": 4.0}
# Tensor-parallel collectives per layer and forward: all-gather + reduce-scatter around the
# attention block and around the MLP (sequence parallelism). Backward has as many; a remat
# policy that recomputes the forward repeats its collectives.
_TP_COLLECTIVES = {"full": 12, "full_offload": 12, "dots": 12, "dots_no_batch": 12, "none": 8}


@dataclasses.dataclass
class AxisComm:
    axis: str
    degree: int
    link: str  # 'nvlink', 'infiniband' or '-'
    bytes_per_step: float  # sent per device per step
    bus_bandwidth: float  # bytes/s
    calls: int
    seconds: float
    overlapped: bool


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


@functools.lru_cache(maxsize=16)
def param_counts(model: ModelConfig) -> tuple[int, int]:
    """(all parameters, parameters without the input embedding), exact, from eval_shape."""
    spec = model_spec(model)
    return spec.count_params(model), spec.count_params(model, exclude_embedding=True)


def _bus_bandwidth(axis: str, layout: Layout, cluster: Cluster, eff: Efficiencies):
    """(link, bytes/s, latency) of a ring over `axis`."""
    hw = cluster.hardware
    nvl = hw.nvlink_bandwidth * eff.nvlink
    if layout.outer[axis] == 1:
        return "nvlink", nvl, eff.nvlink_latency_s
    return "infiniband", min(nvl, layout.inner[axis] * hw.ib_rail_bandwidth * eff.ib), \
        eff.ib_latency_s


def estimate(cfg: Config, cluster: Cluster, layout: Layout,
             eff: Efficiencies = EFFICIENCIES) -> Estimate:
    m, t_cfg, hw = cfg.model, cfg.train, cluster.hardware
    deg = layout.degrees
    dp, fsdp, tp, pp = deg["data"], deg["fsdp"], deg["tensor"], deg["pipeline"]
    accum = t_cfg.grad_accum
    micro = cfg.pipeline.microbatches if pp > 1 else 1
    virtual = cfg.pipeline.resolved_virtual_stages if pp > 1 else 1
    L, d, V, S = m.n_layers, m.d_model, m.vocab_size, t_cfg.seq_len
    n_params, n_no_embed = param_counts(m)
    tokens = t_cfg.batch_size * S
    fpt = flops_per_token(m, S, n_no_embed)
    flops_step = fpt * tokens

    # --- memory per device (plan/memory_model.py) -----------------------------------------
    memory, host_memory = memory_per_device(cfg, deg, n_params)
    local_params = param_split(m, n_params, deg).total
    act_bytes = 4 if m.dtype == "float32" else 2
    tokens_pipe_micro = tokens / (accum * dp * fsdp * micro)
    usable = hw.hbm_bytes * eff.usable_memory

    # --- compute -----------------------------------------------------------------------------
    peak = hw.fp8_flops if m.matmul_precision in ("fp8_tensorwise", "fp8_delayed", "mxfp8") \
        else hw.bf16_flops
    attn_model_flops = 12.0 * L * d * S * tokens  # fwd + bwd, causal counted in full
    # The decoder layers' matmuls are rematerialised per the policy; the output layer is not.
    output_flops = 6.0 * d * V * tokens
    layer_gemm_flops = 6.0 * n_no_embed * tokens - output_flops
    # The output layer and loss run once per microbatch, spread over the pipeline stages
    # (gpipe and circular with microbatches divisible by the stages); otherwise one stage
    # (1f1b: the last) or every stage runs it for all of them, and the others wait: pp-1
    # extra copies of its 6 d V FLOPs per token on the critical path, never FP8.
    spread = pp == 1 or (cfg.pipeline.schedule != "1f1b" and micro % pp == 0)
    redundant_output = 0.0 if spread else \
        (pp - 1) * 6.0 * d * V * tokens / cluster.n_gpus / (hw.bf16_flops * eff.gemm)
    gemm_passes = (_PIPELINE_GEMM_PASSES if pp > 1 else _GEMM_PASSES)[m.remat]
    attn_passes = (_PIPELINE_ATTN_PASSES if pp > 1 else _ATTN_PASSES)[m.remat]
    gemm_s = ((layer_gemm_flops * gemm_passes / 3 + output_flops) / cluster.n_gpus
              / (peak * eff.gemm) + redundant_output)
    # Fused kernels skip the masked half of causal attention; they run at bf16 rate.
    attn_s = (attn_model_flops * 0.5 * attn_passes / 3 / cluster.n_gpus
              / (hw.bf16_flops * eff.attention))
    # Elementwise traffic per token and layer, one forward: two RMSNorms, RoPE on q and k,
    # SwiGLU and two residual adds read/write ~ 12 d + 3 f values.
    fwd_bytes = (12 * d + 3 * m.ffn_dim) * act_bytes * L * tokens / (dp * fsdp * tp * pp)
    elem_s = fwd_bytes * gemm_passes / (hw.hbm_bandwidth * eff.hbm)
    compute_s = gemm_s + attn_s + elem_s

    # --- communication per axis --------------------------------------------------------------
    comm: dict[str, AxisComm] = {}

    def add(axis, nbytes, calls, overlapped):
        n = deg[axis]
        if n == 1:
            return
        link, bw, lat = _bus_bandwidth(axis, layout, cluster, eff)
        comm[axis] = AxisComm(axis, n, link, nbytes, bw, calls, nbytes / bw + calls * lat,
                              overlapped)

    stage_layers = L / pp
    # FSDP: all-gather the bf16 weights for the forward and again for the backward, and
    # reduce-scatter the gradients (in the compute dtype, or float32 by
    # model.grad_reduce_dtype), once per grad-accumulation microbatch.
    grad_bytes = 4 if m.grad_reduce_dtype == "float32" else act_bytes
    fsdp_group_params = n_params / (tp * pp)
    add("fsdp", accum * (fsdp - 1) / fsdp * fsdp_group_params * (2 * act_bytes + grad_bytes),
        3 * accum * (L // pp + 2), overlapped=True)
    # Data parallel: all-reduce of the gradients of this device's shard, per microbatch.
    add("data", accum * 2 * (dp - 1) / dp * local_params * grad_bytes, accum * (L // pp + 2),
        overlapped=True)
    # Tensor parallel: sequence-parallel all-gathers / reduce-scatters of the residual stream
    # [tokens of this data x fsdp shard, d], _TP_COLLECTIVES of them per layer.
    tp_calls = _TP_COLLECTIVES[m.remat] * stage_layers * accum * micro
    add("tensor", tp_calls * (tp - 1) / tp * tokens_pipe_micro * d * act_bytes, int(tp_calls),
        overlapped=False)
    # Pipeline: each of the v*m + p - 1 iterations of the schedule passes one microbatch's
    # activations to the next stage, forward and backward (point to point, one hop).
    pp_iters = (micro + 2 * (pp - 1) if cfg.pipeline.schedule == "1f1b"
                else virtual * micro + pp - 1) * accum
    add("pipeline", 2 * pp_iters * tokens_pipe_micro * d * act_bytes / tp, 2 * pp_iters,
        overlapped=False)
    if "pipeline" in comm:  # a send/recv moves the whole message, not (n-1)/n of it
        c = comm["pipeline"]
        if c.link == "infiniband":  # one hop on one rail, not a ring over many
            c.bus_bandwidth = cluster.hardware.ib_rail_bandwidth * eff.ib
            c.seconds = c.bytes_per_step / c.bus_bandwidth + c.calls * eff.ib_latency_s

    # --- host link (offload options), per device: one direction each way, full duplex -------
    host_bw = hw.host_bandwidth * eff.host
    split = param_split(m, n_params, deg)
    pbytes = 4 if m.param_dtype == "float32" else 2
    host_hidden = host_exposed = 0.0
    if m.remat == "full_offload":  # layer inputs out in the forward, back in the backward
        host_hidden += host_memory.get("saved_activations", 0.0) * accum / host_bw
    if cfg.train.offload_params:
        # each layer's master slice read for the forward, the recompute and the backward,
        # its gradient written back, per accumulation step; hidden under the layers' compute
        host_hidden += accum * split.layers * max(3 * pbytes, 4) / host_bw
    # The update streams what lives on the host through HBM once per step, after the
    # backward: nothing to hide it under. Reads and writes overlap (full duplex).
    update_read = (8 if cfg.train.offload_optimizer else 0) * split.total \
        + (pbytes + 4 if cfg.train.offload_params else 0) * split.layers
    update_write = (8 if cfg.train.offload_optimizer else 0) * split.total \
        + (pbytes if cfg.train.offload_params else 0) * split.layers
    host_exposed = max(update_read, update_write) / host_bw

    exposed = sum(c.seconds for c in comm.values() if not c.overlapped)
    hidden = max(sum(c.seconds for c in comm.values() if c.overlapped), host_hidden)
    bubble = (pp - 1) / (micro + pp - 1) / virtual if pp > 1 else 0.0
    pipelined = (compute_s + exposed) / (1 - bubble)
    # AdamW update: read weights, gradient and two moments, write three (fp32), memory bound.
    optimizer_s = local_params * (4 * 4 + 3 * 4) / (hw.hbm_bandwidth * eff.hbm)
    step_s = max(pipelined, hidden) + optimizer_s + host_exposed
    tps = tokens / step_s / cluster.n_gpus
    return Estimate(
        params=n_params, params_no_embed=n_no_embed, tokens_per_step=tokens,
        flops_per_token=fpt, flops_per_step=flops_step, memory=memory, host_memory=host_memory,
        usable_memory_bytes=usable, fits=memory["total"] <= usable, comm=comm,
        compute_s=compute_s, bubble=bubble, step_s=step_s, tokens_per_s_per_gpu=tps,
        mfu=tps * fpt / hw.bf16_flops,
        breakdown_s={"gemm": gemm_s, "attention": attn_s, "elementwise": elem_s,
                     "exposed_comm": exposed, "overlapped_comm": hidden,
                     "bubble": pipelined - compute_s - exposed, "optimizer": optimizer_s,
                     "host_offload_exposed": host_exposed, "host_offload_overlapped": host_hidden})
