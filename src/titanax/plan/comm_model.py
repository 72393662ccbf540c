"""Communication time of one train step per device: one function per mesh axis (fsdp, data,
tensor, pipeline, context, expert) and one for the host link of the offload options.

Collective time over an axis of degree n (ring, as NCCL runs it): bytes moved per device
(all-gather / reduce-scatter (n-1)/n x S, all-reduce 2(n-1)/n x S) over the axis' bus
bandwidth: NVLink when the axis stays inside an NVLink domain; when it crosses domains the
ring's bottleneck is the InfiniBand hop, where the axis' n_inner GPUs of a domain each drive
their own rail: min(NVLink, n_inner x rail) (build_mesh keeps cross-domain rings rail-aligned).
A collective over a group of axes (FSDP over fsdp x context) runs one ring over all their
devices: it crosses domains when any of them does, with the group's GPUs inside a domain each
on its own rail. Plus a fixed latency per collective call.

What the run trains says which gradients the FSDP group and the data-parallel all-reduce move
(plan/training.py; under LoRA, plan/lora.py: FSDP still gathers the frozen base for every
forward and backward, but only the adapters have gradients to reduce: their d_model-side
factors are sharded over fsdp x context (reduce-scattered), their other side is whole on each
FSDP rank (all-reduced)).

The weights' layout says what FSDP gathers and over which batch axes each gradient is summed
(plan/param_layout.py; a mixture of experts', docs/moe.md, Planner: each parameter at its size
over the other mesh axes, the experts' weights split over 'expert' as well, and summed over
the batch axes the parameter is whole over, 'expert' too for all but the experts' weights);
'expert' carries the architecture's dispatch all-to-alls (expert_comm, plan/moe.py), on the
critical path, over NVLink or InfiniBand as any ring over the axis.
"""

from __future__ import annotations

import dataclasses
import math

from titanax.config import Config, ModelConfig, tp_overlap_unsupported
from titanax.plan.cluster import Cluster, Layout
from titanax.plan.compute_model import attention_passes, attention_seconds
from titanax.plan.efficiencies import Efficiencies
from titanax.plan.memory_model import param_split
from titanax.plan.moe import EXPERT_AXIS, all_to_all_bytes
from titanax.plan.param_layout import param_shards
from titanax.plan.state_shape import plan_state
from titanax.plan.step_shape import StepShape

# The sequence-parallel collectives on 'tensor' of one layer, per pass. The row-parallel side
# (after wo and w_down, and dx of the column matmuls in the backward) reduces; XLA does that as
# an all-reduce of the whole sequence and a slice (ops/linear multiplies [B*S, K] GEMMs, so the
# partitioner never sees the sequence sharding; `python -m launch.bench tp_overlap`), the
# collective matmul as a ring reduce-scatter. A recompute under remat skips w_down's: its
# output is not needed again (the same HLO: 5 all-reduces and 6 all-gathers per layer).
TP_FORWARD = ("qkv", "wo", "gate_up", "w_down")
TP_RECOMPUTED = ("qkv", "wo", "gate_up")
# Remat policies that recompute the layer's forward (with its collectives) in the backward.
# 'dots' saves the GEMM outputs but not the gathered inputs, so its gathers rerun too.
RECOMPUTING_REMATS = ("full", "full_offload", "dots", "dots_no_batch")


@dataclasses.dataclass
class AxisComm:
    axis: str
    degree: int
    link: str  # 'nvlink', 'infiniband' or '-'
    bytes_per_step: float  # sent per device per step
    bus_bandwidth: float  # bytes/s
    calls: int
    seconds: float
    overlapped: bool  # asynchronous, hidden under the whole step's compute (FSDP, data)
    # Of the `seconds` of a collective on the critical path (overlapped False), those hidden
    # under the computation it runs beside (the context ring's sends under the attention of the
    # block in hand, the tensor ring's under its GEMM steps); the rest is exposed.
    hidden_s: float = 0.0
    over: tuple[str, ...] = ()  # the mesh axes it runs over; () = (axis,)

    @property
    def exposed_s(self) -> float:
        return 0.0 if self.overlapped else self.seconds - self.hidden_s


@dataclasses.dataclass(frozen=True)
class Network:
    """The links a mesh axis runs over on this cluster, at their achievable bandwidth."""
    layout: Layout
    cluster: Cluster
    eff: Efficiencies

    def bus_bandwidth(self, axis: str | tuple[str, ...]) -> tuple[str, float, float]:
        """(link, bytes/s, latency) of a ring over `axis`, or over a group of axes: one ring
        through all their devices, as slow as its slowest link (InfiniBand as soon as one axis
        of the group crosses domains, then driven by the group's GPUs in a domain, one rail
        each)."""
        hw, eff = self.cluster.hardware, self.eff
        group = (axis,) if isinstance(axis, str) else axis
        nvl = hw.nvlink_bandwidth * eff.nvlink
        if all(self.layout.outer[a] == 1 for a in group):
            return "nvlink", nvl, eff.nvlink_latency_s
        rails = math.prod(self.layout.inner[a] for a in group)
        return "infiniband", min(nvl, rails * hw.ib_rail_bandwidth * eff.ib), eff.ib_latency_s

    def point_to_point(self, axis: str) -> tuple[str, float, float]:
        """(link, bytes/s, latency) of a send to the neighbour along `axis`: the whole message
        over one link, NVLink inside a domain, the GPU's own rail when the axis crosses."""
        hw, eff = self.cluster.hardware, self.eff
        if self.layout.outer[axis] == 1:
            return "nvlink", hw.nvlink_bandwidth * eff.nvlink, eff.nvlink_latency_s
        return "infiniband", hw.ib_rail_bandwidth * eff.ib, eff.ib_latency_s

    def ring(self, axis: str, nbytes: float, calls, overlapped: bool,
             over: tuple[str, ...] = ()) -> AxisComm | None:
        """A ring collective over `axis` (or over the group of mesh axes `over`, reported as
        `axis`), None where it has degree 1 (nothing moves)."""
        group = over or (axis,)
        n = math.prod(self.layout.degrees[a] for a in group)
        if n == 1:
            return None
        link, bw, lat = self.bus_bandwidth(group)
        return AxisComm(axis, n, link, nbytes, bw, calls, nbytes / bw + calls * lat, overlapped,
                        over=over)


def _grad_bytes(cfg: Config, shape: StepShape) -> int:
    # Gradients are reduced in the compute dtype, or float32 by execution.grad_reduce_dtype.
    return 4 if cfg.execution.grad_reduce_dtype == "float32" else shape.act_bytes


def fsdp_comm(cfg: Config, shape: StepShape, net: Network) -> AxisComm | None:
    # All-gather the bf16 weights for the forward and again for the backward, and
    # reduce-scatter the gradients, once per grad-accumulation microbatch, over the group
    # the parameters are sharded over: fsdp x context.
    deg, accum, act_bytes = shape.deg, shape.accum, shape.act_bytes
    shards, pp = param_shards(deg), deg["pipeline"]
    state = plan_state(cfg)
    fsdp_group_params = state.layout.fsdp_gathered(deg)
    share = (shards - 1) / shards
    gathered = share * fsdp_group_params * 2 * act_bytes  # forward and backward all-gathers
    # the gradients of what the run trains (LoRA: the adapters', module docstring)
    grads = state.training.fsdp_gradient_elems(deg, fsdp_group_params)
    nbytes = gathered + share * grads * _grad_bytes(cfg, shape)
    ring = net.ring("fsdp", accum * nbytes, 3 * accum * (cfg.model.n_layers // pp + 2),
                    overlapped=True, over=("fsdp", "context") if shape.context > 1 else ())
    if ring is not None and not cfg.execution.loop_double_buffering:
        # The layer loop single-buffered: the next layer's weight all-gather has no buffer to
        # fill during this layer's compute, so the all-gathers (forward and backward) are
        # taken as exposed; the gradients' reduce-scatters stay hidden.
        exposed = accum * gathered / ring.bus_bandwidth
        ring = dataclasses.replace(ring, overlapped=False,
                                   hidden_s=max(ring.seconds - exposed, 0.0))
    return ring


def data_comm(cfg: Config, shape: StepShape, net: Network) -> AxisComm | None:
    """The gradients' all-reduce per microbatch over the batch axes beside the FSDP group's
    each is whole over (a dense model's, and LoRA's adapters: 'data'; a mixture of experts'
    also 'expert' for all but the experts' weights), one ring per such group, reported as one
    row."""
    state = plan_state(cfg)
    groups = state.training.gradient_groups(shape.deg, state.layout)
    calls = shape.accum * (cfg.model.n_layers // shape.deg["pipeline"] + 2)
    rings = []
    for axes, elems in groups.items():
        n = math.prod(shape.deg.get(a, 1) for a in axes)
        if n > 1:
            nbytes = shape.accum * 2 * (n - 1) / n * elems * _grad_bytes(cfg, shape)
            rings.append(net.ring("data", nbytes, calls, overlapped=True, over=axes))
    if not rings:
        return None
    widest = max(rings, key=lambda c: c.degree)
    return AxisComm("data", widest.degree, widest.link, sum(c.bytes_per_step for c in rings),
                    widest.bus_bandwidth, sum(c.calls for c in rings),
                    sum(c.seconds for c in rings), overlapped=True,
                    over=() if widest.over == ("data",) else widest.over)


def expert_comm(cfg: Config, shape: StepShape, net: Network) -> AxisComm | None:
    """Expert parallelism's all-to-alls over 'expert' (plan/moe.py: per MoE layer and
    microbatch, (ep - 1)/ep of each [ep, C, D] buffer sent, forward, backward and the remat's
    recompute): the layer's experts wait for them, so they are exposed. The axis' link and
    bandwidth as for a ring over it (NVLink while tensor x expert fit in a domain)."""
    recomputes = cfg.execution.remat in RECOMPUTING_REMATS
    nbytes, calls = all_to_all_bytes(cfg, shape, recomputes)
    if not calls:
        return None
    return net.ring(EXPERT_AXIS, nbytes, calls, overlapped=False)


@dataclasses.dataclass(frozen=True)
class TPCollective:
    """One sequence-parallel collective of a layer pass: which matmul it serves, whether it
    reduces (else gathers), and n, the per-device width of the GEMM beside each ring step in
    the collective matmul (column: its local output features; row: its local inputs)."""
    matmul: str
    reduces: bool
    width: float
    backward: bool


def _tp_width(m: ModelConfig, tp: int, matmul: str) -> float:
    hd = m.resolved_head_dim
    return {"qkv": (m.n_heads + 2 * m.n_kv_heads) * hd, "wo": m.n_heads * hd,
            "gate_up": 2 * m.ffn_dim, "w_down": m.ffn_dim}[matmul] / tp


def tp_layer_collectives(cfg: Config, shape: StepShape) -> list[TPCollective]:
    """Every tensor collective one layer runs per microbatch: the forward, a pipeline tick's
    recompute of it (the schedule checkpoints each tick, compute_model.PIPELINE_GEMM_PASSES),
    the remat policy's recompute (less w_down's), and the backward, where the roles swap
    (the column matmuls reduce-scatter dx, the row ones gather dy)."""
    m, tp = cfg.model, shape.deg["tensor"]
    forwards = [TP_FORWARD] * (2 if shape.deg["pipeline"] > 1 else 1)
    if cfg.execution.remat in RECOMPUTING_REMATS:
        forwards.append(TP_RECOMPUTED)
    out = [TPCollective(mm, mm in ("wo", "w_down"), _tp_width(m, tp, mm), False)
           for names in forwards for mm in names]
    return out + [TPCollective(mm, mm in ("qkv", "gate_up"), _tp_width(m, tp, mm), True)
                  for mm in TP_FORWARD]


def tp_overlap_applies(cfg: Config, shape: StepShape) -> bool:
    """Whether the run uses the collective matmul (parallel/collective_matmul.py): asked for,
    tensor > 1, none of the config's refusals (FP8 recipes, 1f1b: tp_overlap_unsupported, the
    runtime's own check), and the sequence cut into context x tensor chunks (else the runtime
    falls back to XLA's collectives)."""
    tp = shape.deg["tensor"]
    return (cfg.execution.tp_overlap and tp > 1 and tp_overlap_unsupported(cfg, shape.deg) is None
            and cfg.train.seq_len % (shape.context * tp) == 0)


def tp_hidden_share(width: float, backward: bool, act_bytes: int, gemm_flops: float,
                    link_bw: float) -> float:
    """Of a ring step's transfer of an [M, d] chunk (act_bytes M d / BW), the share the GEMM
    beside it covers (2 M d n / R): n BW / R in bf16; the backward runs two GEMMs a step."""
    ratio = 2 * width * link_bw / (act_bytes * gemm_flops)
    return min(1.0, (2 if backward else 1) * ratio)


def tensor_comm(cfg: Config, shape: StepShape, net: Network) -> AxisComm | None:
    """The layers' sequence-parallel collectives over 'tensor', on the residual stream of one
    (accumulation, pipeline) microbatch [tokens of this data x fsdp x context shard, d]:
    tp_layer_collectives() of them per layer, x L/pp x a m."""
    tp = shape.deg["tensor"]
    if tp == 1:
        return None
    if tp_overlap_applies(cfg, shape):
        return _tensor_ring_comm(cfg, shape, net)
    return _tensor_xla_comm(cfg, shape, net)


def _tensor_runs(cfg: Config, shape: StepShape) -> float:
    return cfg.model.n_layers / shape.deg["pipeline"] * shape.accum * shape.micro


def _tensor_xla_comm(cfg: Config, shape: StepShape, net: Network) -> AxisComm | None:
    """XLA's partitioning: whole all-gathers ((tp-1)/tp of the sequence) and whole-sequence
    all-reduces (twice that), between dependent matmuls: all exposed."""
    tp, runs = shape.deg["tensor"], _tensor_runs(cfg, shape)
    seq_bytes = shape.tokens_pipe_micro * cfg.model.d_model * shape.act_bytes
    cols = tp_layer_collectives(cfg, shape)
    units = sum(2 if c.reduces else 1 for c in cols)
    return net.ring("tensor", runs * units * (tp - 1) / tp * seq_bytes, int(runs * len(cols)),
                    overlapped=False)


def _tensor_ring_comm(cfg: Config, shape: StepShape, net: Network) -> AxisComm:
    """The collective matmul: each collective is tp-1 point-to-point sends of one [M, d] chunk
    (M = the microbatch's tokens / tp), each beside a GEMM step that hides a share h of it
    (tp_hidden_share). One send per collective is never hidden (the ring's fill), nor is the
    per-send latency."""
    tp, runs, act = shape.deg["tensor"], _tensor_runs(cfg, shape), shape.act_bytes
    link, bw, lat = net.point_to_point("tensor")
    r = net.cluster.hardware.bf16_flops * net.eff.gemm
    step_s = shape.tokens_pipe_micro / tp * cfg.model.d_model * act / bw
    cols = tp_layer_collectives(cfg, shape)
    calls = runs * len(cols) * (tp - 1)
    hidden = runs * sum(tp_hidden_share(c.width, c.backward, act, r, bw) * (tp - 2) * step_s
                        for c in cols)
    return AxisComm("tensor", tp, link, calls * step_s * bw, bw, int(calls),
                    calls * (step_s + lat), overlapped=False, hidden_s=hidden)


def pipeline_comm(cfg: Config, shape: StepShape, net: Network) -> AxisComm | None:
    # Each of the v*m + p - 1 iterations of the schedule passes one microbatch's activations
    # to the next stage, forward and backward (point to point, one hop).
    pp, micro = shape.deg["pipeline"], shape.micro
    pp_iters = (micro + 2 * (pp - 1) if cfg.pipeline.schedule == "1f1b"
                else shape.virtual * micro + pp - 1) * shape.accum
    c = net.ring("pipeline", 2 * pp_iters * shape.tokens_pipe_micro * cfg.model.d_model
                 * shape.act_bytes / shape.deg["tensor"], 2 * pp_iters, overlapped=False)
    # A send/recv moves the whole message, not (n-1)/n of it; across domains it is one hop on
    # one rail, not a ring over many.
    if c is not None and c.link == "infiniband":
        c.bus_bandwidth = net.cluster.hardware.ib_rail_bandwidth * net.eff.ib
        c.seconds = c.bytes_per_step / c.bus_bandwidth + c.calls * net.eff.ib_latency_s
    return c


def context_kv_block_bytes(cfg: Config, shape: StepShape) -> float:
    """One K (or V) block a context rank holds, [rows, S/context, kv_heads/tensor, head_dim] in
    the compute dtype, for one (accumulation, pipeline) microbatch."""
    m = cfg.model
    return (shape.tokens_pipe_micro * m.n_kv_heads * m.resolved_head_dim / shape.deg["tensor"]
            * shape.act_bytes)


def context_comm(cfg: Config, shape: StepShape, net: Network) -> AxisComm | None:
    """The attention's K/V exchange over 'context', per layer and microbatch (B: one K block,
    C: mesh.context, f: forward passes of attention, 2 with a remat policy that recomputes it):
    ring: f (C - 1) ppermutes of K and V, then in the backward C - 1 of K and V again and C of
    the float32 dK, dV accumulators; each send overlaps the attention of the block in hand, so
    up to (C - 1)/C of the step's attention time hides them and the rest is exposed.
    all_gather: f + 1 all-gathers of K and V, each receiving (C - 1) x 2B, and one
    reduce-scatter of the float32 dK, dV; exposed (nothing to overlap them with)."""
    c = shape.context
    if c == 1:
        return None
    m, pp = cfg.model, shape.deg["pipeline"]
    kv = 2 * context_kv_block_bytes(cfg, shape)  # K and V
    dkv = kv * 4 / shape.act_bytes  # their float32 gradients
    forwards = attention_passes(cfg, shape) - 2  # the backward counts two passes
    layer_runs = m.n_layers / pp * shape.accum * shape.micro
    if cfg.execution.context_strategy == "all_gather":
        return net.ring("context", layer_runs * (c - 1) * ((forwards + 1) * kv + dkv),
                        int(layer_runs * (forwards + 2)), overlapped=False)
    link, bw, lat = net.point_to_point("context")
    nbytes = layer_runs * ((forwards + 1) * (c - 1) * kv + c * dkv)
    calls = int(layer_runs * ((forwards + 1) * (c - 1) + c))
    seconds = nbytes / bw + calls * lat
    hidden = min(seconds, attention_seconds(cfg, shape, net.cluster, net.eff) * (c - 1) / c)
    return AxisComm("context", c, link, nbytes, bw, calls, seconds, overlapped=False,
                    hidden_s=hidden)


def axis_comms(cfg: Config, shape: StepShape, net: Network) -> dict[str, AxisComm]:
    """{axis: its traffic} for every mesh axis of degree above 1."""
    comms = (fsdp_comm(cfg, shape, net), data_comm(cfg, shape, net),
             tensor_comm(cfg, shape, net), pipeline_comm(cfg, shape, net),
             context_comm(cfg, shape, net), expert_comm(cfg, shape, net))
    return {c.axis: c for c in comms if c is not None}


def host_link_seconds(cfg: Config, shape: StepShape,
                      host_memory: dict[str, float], cluster: Cluster, eff: Efficiencies
                      ) -> tuple[float, float]:
    """(seconds hidden under the layers' compute, seconds exposed after the backward) of the
    offload options' copies over the host link, per device: one direction each way, full
    duplex."""
    m, t = cfg.model, cfg.train
    host_bw = cluster.hardware.host_bandwidth * eff.host
    split = param_split(cfg, shape.deg)
    pbytes = 4 if m.param_dtype == "float32" else 2
    hidden = 0.0
    if cfg.execution.remat == "full_offload":  # layer inputs out in the forward, back in the backward
        hidden += host_memory.get("saved_activations", 0.0) * shape.accum / host_bw
    host_grads = t.offload_params and t.grad_accum == 1
    if t.offload_params and host_grads:
        # each layer's master slice read for the forward, the recompute and the backward,
        # its gradient written back; hidden under the layers' compute
        hidden += split.layers * max(3 * pbytes, 4) / host_bw
    elif t.offload_params:
        # summed in place (models/accumulate.py): read for the forward and once for the
        # backward's recompute and VJP, per microbatch; the gradients stay on the device
        hidden += shape.accum * split.layers * 2 * pbytes / host_bw
    # The update streams what lives on the host through HBM once per step, after the
    # backward: nothing to hide it under. Reads and writes overlap (full duplex).
    update_read = (8 if t.offload_optimizer else 0) * split.total \
        + ((pbytes + (4 if host_grads else 0)) if t.offload_params else 0) * split.layers
    update_write = (8 if t.offload_optimizer else 0) * split.total \
        + (pbytes if t.offload_params else 0) * split.layers
    return hidden, max(update_read, update_write) / host_bw
