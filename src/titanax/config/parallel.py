"""The mesh and pipeline sections: how many devices each parallelism takes, and the pipeline's
schedule. Checks across sections (heads against mesh.tensor, layers against stages) are in
rules.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titanax.config.errors import check_choice, check_positive, check_types, fail

PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b")

# THE batch rule: the mesh axes a step's rows split over (parallel/rules.py's 'batch'
# activation rule is this tuple). An expert rank is a data-parallel one outside the experts.
BATCH_AXES = ("expert", "data", "fsdp")


def batch_ways(degrees) -> int:
    """How many ways a step's rows split: the product of BATCH_AXES' degrees (degrees: a
    dict or a mesh's shape; an axis it lacks counts 1). Every batch check calls this."""
    return math.prod(degrees.get(a, 1) for a in BATCH_AXES)


@dataclass(frozen=True)
class MeshConfig:
    # Degrees of each mesh axis; -1 takes whatever devices are left (at most one axis).
    data: int = -1
    fsdp: int = 1  # parameters, gradients and moments sharded, gathered per layer (ZeRO-3)
    tensor: int = 1  # Megatron tensor + sequence parallelism; keep within an NVLink domain
    pipeline: int = 1  # pipeline stages (the layer stack split; pipeline.schedule runs it)
    # Context parallelism: each sequence split over this many devices (load-balanced causal
    # chunks; parallel/context.py), attention exchanging K/V between them.
    # (execution.context_strategy picks how attention exchanges K/V over it.)
    context: int = 1
    # Expert parallelism (mixture-of-experts models): the experts split over this many devices,
    # tokens sent to their experts' devices and back by all-to-all; also splits the batch.
    expert: int = 1
    nvlink_domain: int = 0  # GPUs per NVLink domain; 0: devices per process

    def degrees(self) -> dict[str, int]:
        return {"pipeline": self.pipeline, "data": self.data, "fsdp": self.fsdp,
                "expert": self.expert, "context": self.context, "tensor": self.tensor}

    def __post_init__(self):
        check_types("mesh", self)
        degrees = self.degrees()
        for name, d in degrees.items():
            if d == 0 or d < -1:
                fail(f"mesh.{name}", f"must be a positive degree or -1 (fill), got {d}")
        if sum(d == -1 for d in degrees.values()) > 1:
            fail("mesh", "only one of data/fsdp/expert/context/tensor/pipeline may be -1 (fill)")
        if self.nvlink_domain < 0:
            fail("mesh.nvlink_domain", "must be >= 0 (0: devices per process)")


@dataclass(frozen=True)
class PipelineConfig:
    # Used when mesh.pipeline > 1 (see parallel/pipeline.py and docs/parallelism.md).
    microbatches: int = 1  # per pipelined forward/backward (per train.grad_accum microbatch)
    # gpipe: one layer chunk per stage, all forwards then all backwards; circular:
    # virtual_stages chunks per stage; 1f1b: gpipe's layout with forwards and backwards
    # interleaved, so a stage holds at most 2 x stages - 1 microbatches' activations
    # whatever pipeline.microbatches is.
    schedule: str = "gpipe"
    virtual_stages: int = 0  # layer chunks per stage; 0: 1 for gpipe, 2 for circular

    @property
    def resolved_virtual_stages(self) -> int:
        return self.virtual_stages or (2 if self.schedule == "circular" else 1)

    def __post_init__(self):
        check_types("pipeline", self)
        check_positive("pipeline", self, "microbatches")
        check_choice("pipeline.schedule", self.schedule, PIPELINE_SCHEDULES)
        if self.virtual_stages < 0:
            fail("pipeline.virtual_stages", "must be >= 0 (0: 1 for gpipe, 2 for circular)")
        if self.schedule in ("gpipe", "1f1b") and self.virtual_stages > 1:
            fail("pipeline.virtual_stages", f"{self.virtual_stages} needs "
                 f"pipeline.schedule=circular ({self.schedule} runs one layer chunk per "
                 "stage)")
        if self.schedule == "circular" and self.virtual_stages == 1:
            fail("pipeline.virtual_stages", "circular with one chunk per stage is gpipe; set "
                 "pipeline.virtual_stages >= 2 or pipeline.schedule=gpipe")
