"""Communication time of one train step per device: one function per mesh axis (fsdp, data,
tensor, pipeline) and one for the host link of the offload options.

Collective time over an axis of degree n (ring, as NCCL runs it): bytes moved per device
(all-gather / reduce-scatter (n-1)/n x S, all-reduce 2(n-1)/n x S) over the axis' bus
bandwidth: NVLink when the axis stays inside an NVLink domain; when it crosses domains the
ring's bottleneck is the InfiniBand hop, where the axis' n_inner GPUs of a domain each drive
their own rail: min(NVLink, n_inner x rail) (build_mesh keeps cross-domain rings rail-aligned).
Plus a fixed latency per collective call.
"""

from __future__ import annotations

import dataclasses

from titanax.config import Config
from titanax.plan.cluster import Cluster, Layout
from titanax.plan.efficiencies import Efficiencies
from titanax.plan.memory_model import param_split
from titanax.plan.step_shape import StepShape

# Tensor-parallel collectives per layer and forward: all-gather + reduce-scatter around the
# attention block and around the MLP (sequence parallelism). Backward has as many; a remat
# policy that recomputes the forward repeats its collectives.
TP_COLLECTIVES = {"full": 12, "full_offload": 12, "dots": 12, "dots_no_batch": 12, "none": 8}


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


@dataclasses.dataclass(frozen=True)
class Network:
    """The links a mesh axis runs over on this cluster, at their achievable bandwidth."""
    layout: Layout
    cluster: Cluster
    eff: Efficiencies

    def bus_bandwidth(self, axis: str) -> tuple[str, float, float]:
        """(link, bytes/s, latency) of a ring over `axis`."""
        hw, eff = self.cluster.hardware, self.eff
        nvl = hw.nvlink_bandwidth * eff.nvlink
        if self.layout.outer[axis] == 1:
            return "nvlink", nvl, eff.nvlink_latency_s
        return "infiniband", min(nvl, self.layout.inner[axis] * hw.ib_rail_bandwidth * eff.ib), \
            eff.ib_latency_s

    def ring(self, axis: str, nbytes: float, calls, overlapped: bool) -> AxisComm | None:
        """A ring collective over `axis`, None where the axis has degree 1 (nothing moves)."""
        n = self.layout.degrees[axis]
        if n == 1:
            return None
        link, bw, lat = self.bus_bandwidth(axis)
        return AxisComm(axis, n, link, nbytes, bw, calls, nbytes / bw + calls * lat, overlapped)


def _grad_bytes(cfg: Config, shape: StepShape) -> int:
    # Gradients are reduced in the compute dtype, or float32 by model.grad_reduce_dtype.
    return 4 if cfg.model.grad_reduce_dtype == "float32" else shape.act_bytes


def fsdp_comm(cfg: Config, shape: StepShape, n_params: int, net: Network) -> AxisComm | None:
    # All-gather the bf16 weights for the forward and again for the backward, and
    # reduce-scatter the gradients, once per grad-accumulation microbatch.
    deg, accum, act_bytes = shape.deg, shape.accum, shape.act_bytes
    fsdp, tp, pp = deg["fsdp"], deg["tensor"], deg["pipeline"]
    fsdp_group_params = n_params / (tp * pp)
    return net.ring("fsdp", accum * (fsdp - 1) / fsdp * fsdp_group_params
                    * (2 * act_bytes + _grad_bytes(cfg, shape)),
                    3 * accum * (cfg.model.n_layers // pp + 2), overlapped=True)


def data_comm(cfg: Config, shape: StepShape, n_params: int, net: Network) -> AxisComm | None:
    # All-reduce of the gradients of this device's shard, per microbatch.
    deg, accum = shape.deg, shape.accum
    dp = deg["data"]
    local_params = param_split(cfg.model, n_params, deg).total
    return net.ring("data", accum * 2 * (dp - 1) / dp * local_params * _grad_bytes(cfg, shape),
                    accum * (cfg.model.n_layers // deg["pipeline"] + 2), overlapped=True)


def tensor_comm(cfg: Config, shape: StepShape, net: Network) -> AxisComm | None:
    # Sequence-parallel all-gathers / reduce-scatters of the residual stream
    # [tokens of this data x fsdp shard, d], TP_COLLECTIVES of them per layer.
    m, tp = cfg.model, shape.deg["tensor"]
    stage_layers = m.n_layers / shape.deg["pipeline"]
    tp_calls = TP_COLLECTIVES[m.remat] * stage_layers * shape.accum * shape.micro
    return net.ring("tensor", tp_calls * (tp - 1) / tp * shape.tokens_pipe_micro * m.d_model
                    * shape.act_bytes, int(tp_calls), overlapped=False)


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


def axis_comms(cfg: Config, shape: StepShape, n_params: int, net: Network
               ) -> dict[str, AxisComm]:
    """{axis: its traffic} for every mesh axis of degree above 1."""
    comms = (fsdp_comm(cfg, shape, n_params, net), data_comm(cfg, shape, n_params, net),
             tensor_comm(cfg, shape, net), pipeline_comm(cfg, shape, net))
    return {c.axis: c for c in comms if c is not None}


def host_link_seconds(cfg: Config, shape: StepShape, n_params: int,
                      host_memory: dict[str, float], cluster: Cluster, eff: Efficiencies
                      ) -> tuple[float, float]:
    """(seconds hidden under the layers' compute, seconds exposed after the backward) of the
    offload options' copies over the host link, per device: one direction each way, full
    duplex."""
    m, t = cfg.model, cfg.train
    host_bw = cluster.hardware.host_bandwidth * eff.host
    split = param_split(m, n_params, shape.deg)
    pbytes = 4 if m.param_dtype == "float32" else 2
    hidden = 0.0
    if m.remat == "full_offload":  # layer inputs out in the forward, back in the backward
        hidden += host_memory.get("saved_activations", 0.0) * shape.accum / host_bw
    if t.offload_params:
        # each layer's master slice read for the forward, the recompute and the backward,
        # its gradient written back, per accumulation step; hidden under the layers' compute
        hidden += shape.accum * split.layers * max(3 * pbytes, 4) / host_bw
    # The update streams what lives on the host through HBM once per step, after the
    # backward: nothing to hide it under. Reads and writes overlap (full duplex).
    update_read = (8 if t.offload_optimizer else 0) * split.total \
        + (pbytes + 4 if t.offload_params else 0) * split.layers
    update_write = (8 if t.offload_optimizer else 0) * split.total \
        + (pbytes if t.offload_params else 0) * split.layers
    return hidden, max(update_read, update_write) / host_bw
