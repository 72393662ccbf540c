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
from titanax.models.llama import count_params
from titanax.plan.cluster import Cluster, Layout
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

# Bytes per token per layer that the backward pass keeps from the forward, in units of
# (bf16) activations: full remat keeps the layer input; 'dots' keeps every matmul output
# (q, k, v, attention output projection, gate, up, down) and the input; 'none' keeps
# everything the layer computes (norm outputs, RoPE'd q/k, SwiGLU products as well).
def _saved_elems_per_token(m: ModelConfig, remat: str) -> float:
    d, f, kv = m.d_model, m.ffn_dim, m.n_kv_heads * m.resolved_head_dim
    q = m.n_heads * m.resolved_head_dim
    if remat == "full":
        return d
    if remat in ("dots", "dots_no_batch"):
        return d + q + 2 * kv + d + 2 * f + d
    return 3 * d + 2 * (q + 2 * kv) + q + d + 4 * f + d


# Forward passes (in units of one forward) each remat policy runs per step: the backward is
# two forwards' worth of matmuls; full remat recomputes the forward once more.
_GEMM_PASSES = {"full": 4.0, "dots": 3.0, "dots_no_batch": 3.0, "none": 3.0}
# Attention is not a dot to the remat policies: it is recomputed under every policy but none.
_ATTN_PASSES = {"full": 4.0, "dots": 4.0, "dots_no_batch": 4.0, "none": 3.0}
# Tensor-parallel collectives per layer and forward: all-gather + reduce-scatter around the
# attention block and around the MLP (sequence parallelism). Backward has as many; a remat
# policy that recomputes the forward repeats its collectives.
_TP_COLLECTIVES = {"full": 12, "dots": 12, "dots_no_batch": 12, "none": 8}


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
    return count_params(model), count_params(model, exclude_embedding=True)


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

    # --- memory per device -----------------------------------------------------------------
    param_bytes = 4 if m.param_dtype == "float32" else 2
    act_bytes = 4 if m.dtype == "float32" else 2
    shards = fsdp * tp * pp  # a parameter is split over these; 'data' replicates it
    local_params = n_params / shards
    layer_params = (n_no_embed - d * V) / L  # one decoder layer
    # Tokens one device holds per grad-accumulation microbatch: its data x fsdp share of the
    # rows; all pipeline microbatches of it are in flight at once (GPipe stores them all).
    tokens_dev = tokens / (accum * dp * fsdp)
    tokens_pipe_micro = tokens_dev / micro
    memory = {
        # fp32 master weights and Adam's two fp32 moments
        "weights_and_optimizer": local_params * (param_bytes + 8),
        # fp32 gradients (with accumulation: the running sum; each microbatch's gradient is
        # reduce-scattered and added into it a layer at a time)
        "gradients": local_params * 4,
        # what the backward keeps from each of this stage's layers, sequence/tensor-sharded
        "saved_activations": (L / pp) * tokens_dev * _saved_elems_per_token(m, m.remat) * act_bytes / tp,
        # Transient, the larger of two phases that never overlap: the backward of one layer
        # (its weights gathered in bf16, two for prefetch, its fp32 gradient before the
        # reduce-scatter, and every activation of the layer recomputed) or the loss (bf16
        # logits from the output matmul and the fp32 copy the loss and its gradient use; every
        # pipeline stage computes them for the whole batch, see parallel/pipeline.py).
        "transient": max(
            layer_params / tp * (2 * act_bytes + 4)
            + tokens_pipe_micro * _saved_elems_per_token(m, "none") * act_bytes / tp,
            # the output layer runs after the pipeline, on all its microbatches at once
            tokens_dev * V / tp * (act_bytes + 4)),
    }
    memory["total"] = sum(memory.values())
    usable = hw.hbm_bytes * eff.usable_memory

    # --- compute -----------------------------------------------------------------------------
    peak = hw.fp8_flops if m.matmul_precision in ("fp8_tensorwise", "fp8_delayed", "mxfp8") \
        else hw.bf16_flops
    attn_model_flops = 12.0 * L * d * S * tokens  # fwd + bwd, causal counted in full
    # The decoder layers' matmuls are rematerialised per the policy; the output layer is not.
    output_flops = 6.0 * d * V * tokens
    layer_gemm_flops = 6.0 * n_no_embed * tokens - output_flops
    # Every pipeline stage runs the output layer (and its backward) on the whole batch: pp-1
    # redundant copies of its 6 d V FLOPs per token, in the compute dtype (never FP8).
    redundant_output = (pp - 1) * 6.0 * d * V * tokens / cluster.n_gpus / (hw.bf16_flops * eff.gemm)
    gemm_s = ((layer_gemm_flops * _GEMM_PASSES[m.remat] / 3 + output_flops) / cluster.n_gpus
              / (peak * eff.gemm) + redundant_output)
    # Fused kernels skip the masked half of causal attention; they run at bf16 rate.
    attn_s = (attn_model_flops * 0.5 * _ATTN_PASSES[m.remat] / 3 / cluster.n_gpus
              / (hw.bf16_flops * eff.attention))
    # Elementwise traffic per token and layer, one forward: two RMSNorms, RoPE on q and k,
    # SwiGLU and two residual adds read/write ~ 12 d + 3 f values.
    fwd_bytes = (12 * d + 3 * m.ffn_dim) * act_bytes * L * tokens / (dp * fsdp * tp * pp)
    elem_s = fwd_bytes * _GEMM_PASSES[m.remat] / (hw.hbm_bandwidth * eff.hbm)
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
    # reduce-scatter the bf16 gradients, once per grad-accumulation microbatch.
    fsdp_group_params = n_params / (tp * pp)
    add("fsdp", 3 * accum * (fsdp - 1) / fsdp * fsdp_group_params * act_bytes,
        3 * accum * (L // pp + 2), overlapped=True)
    # Data parallel: all-reduce of the gradients (bf16) of this device's shard, per microbatch.
    add("data", accum * 2 * (dp - 1) / dp * n_params / shards * act_bytes, accum * (L // pp + 2),
        overlapped=True)
    # Tensor parallel: sequence-parallel all-gathers / reduce-scatters of the residual stream
    # [tokens of this data x fsdp shard, d], _TP_COLLECTIVES of them per layer.
    tp_calls = _TP_COLLECTIVES[m.remat] * stage_layers * accum * micro
    add("tensor", tp_calls * (tp - 1) / tp * tokens_pipe_micro * d * act_bytes, int(tp_calls),
        overlapped=False)
    # Pipeline: each of the v*m + p - 1 iterations of the schedule passes one microbatch's
    # activations to the next stage, forward and backward (point to point, one hop).
    pp_iters = (virtual * micro + pp - 1) * accum
    add("pipeline", 2 * pp_iters * tokens_pipe_micro * d * act_bytes / tp, 2 * pp_iters,
        overlapped=False)
    if "pipeline" in comm:  # a send/recv moves the whole message, not (n-1)/n of it
        c = comm["pipeline"]
        if c.link == "infiniband":  # one hop on one rail, not a ring over many
            c.bus_bandwidth = cluster.hardware.ib_rail_bandwidth * eff.ib
            c.seconds = c.bytes_per_step / c.bus_bandwidth + c.calls * eff.ib_latency_s

    exposed = sum(c.seconds for c in comm.values() if not c.overlapped)
    hidden = sum(c.seconds for c in comm.values() if c.overlapped)
    bubble = (pp - 1) / (micro + pp - 1) / virtual if pp > 1 else 0.0
    pipelined = (compute_s + exposed) / (1 - bubble)
    # AdamW update: read weights, gradient and two moments, write three (fp32), memory bound.
    optimizer_s = local_params * (4 * 4 + 3 * 4) / (hw.hbm_bandwidth * eff.hbm)
    step_s = max(pipelined, hidden) + optimizer_s
    tps = tokens / step_s / cluster.n_gpus
    return Estimate(
        params=n_params, params_no_embed=n_no_embed, tokens_per_step=tokens,
        flops_per_token=fpt, flops_per_step=flops_step, memory=memory,
        usable_memory_bytes=usable, fits=memory["total"] <= usable, comm=comm,
        compute_s=compute_s, bubble=bubble, step_s=step_s, tokens_per_s_per_gpu=tps,
        mfu=tps * fpt / hw.bf16_flops,
        breakdown_s={"gemm": gemm_s, "attention": attn_s, "elementwise": elem_s,
                     "exposed_comm": exposed, "overlapped_comm": hidden,
                     "bubble": pipelined - compute_s - exposed, "optimizer": optimizer_s})
