"""The achievable fractions of datasheet figures the cost model runs at (`Efficiencies`), each
with where it comes from; never fitted to the published throughputs docs/planner.md compares
against."""

from __future__ import annotations

import dataclasses


# `duplicates` pairs these fields with other frozen dataclasses' (perf/tp_overlap.py,
# FlashConfig): a list of named defaults alike in shape only, no logic to share.
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
