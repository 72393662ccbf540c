"""--search: enumerate layouts (mesh degrees, pipeline schedule and microbatches), gradient
accumulation and remat policies for a cluster; keep those that fit, rank them by predicted
tokens/s per GPU, and say why each of the others was dropped. The global batch, sequence
length and model stay as configured (they are the experiment; the layout is the means).

Context parallelism: powers of two that fit in an NVLink domain beside tensor (its K/V
exchange runs inside every attention), with both strategies (ring, all_gather); a sequence
that does not split into 2 x context chunks per tensor shard is dropped by the config's own
check (config.check_parallel_layout), with its message.

Tensor-parallel overlap (execution.tp_overlap, the collective matmul): on for every tensor > 1
candidate the config accepts it for. Off is not tried beside it: the cost model never ranks it
faster (its collectives are the ring's bytes or more, all exposed) and the memory model does
not tell them apart. Where the config refuses it (FP8 recipes, 1f1b) the candidate runs without.

What the run trains (plan/training.py) says which pipeline schedules and host offloads are
generated: under LoRA neither host offload nor, with a pipeline, the 1f1b schedule (the config
refuses both with LoRA, docs/lora.md), so they would only swell the dropped list.

Expert parallelism: every mesh.expert the model's experts split into (ModelConfig.splits_experts:
for a mixture of experts, config/moe.py, those dividing model.n_experts) and the devices left
beside tensor, context and pipeline, the rows then split over expert x data x fsdp; a dense
model keeps mesh.expert=1. tp_overlap is not generated where the model refuses it
(ModelConfig.tp_overlap_refusal: an MoE's experts have no collective matmul, docs/moe.md); what
else the config refuses for an MoE (a batch that does not split, pipelines with expert
parallelism) is dropped with its message.
"""

from __future__ import annotations

import dataclasses
import itertools

from pallas_kernels.flash_attention.backends import BACKENDS as ATTENTION_BACKENDS
from titanax.config import Config, ConfigError, tp_overlap_unsupported
from titanax.plan.cluster import Cluster, layout_for
from titanax.plan.cost_model import Estimate, estimate
from titanax.plan.state_shape import plan_state

REMATS = ("none", "dots", "full", "full_offload")  # dots_no_batch plans like dots here: the
GRAD_ACCUMS = (1, 2, 4, 8, 16)                     # layer's dots have no batch dimensions
# Host offload (train.offload_optimizer, train.offload_params): Adam's moments, then also the
# layers' master weights, in pinned host memory, streamed through HBM.
OFFLOADS = ((False, False), (True, False), (True, True))
MICROBATCH_MULTIPLES = (1, 2, 4, 8)  # pipeline microbatches per stage
VIRTUAL_STAGES = (2, 4, 5)
CONTEXT_STRATEGIES = ("ring", "all_gather")


@dataclasses.dataclass
class Candidate:
    cfg: Config
    label: str
    estimate: Estimate | None = None
    dropped: str = ""  # why it was dropped; '' while it stands

    def row(self) -> dict:
        e = self.estimate
        row = {"layout": self.label, "dropped": self.dropped}
        if e is not None:
            row.update(predicted_tokens_per_s_per_gpu=round(e.tokens_per_s_per_gpu, 1),
                       predicted_mfu=round(e.mfu, 4), per_device_bytes=int(e.memory["total"]))
        return row


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _label(tp, pp, dp, fsdp, remat, accum, pipe, offload, context=(1, "ring"),
           tp_overlap=False, expert=1) -> str:
    parts = [f"tensor={tp}", f"pipeline={pp}", f"data={dp}", f"fsdp={fsdp}"]
    if expert > 1:
        parts.append(f"expert={expert}")
    if context[0] > 1:
        parts.append(f"context={context[0]}({context[1]})")
    if pp > 1:
        parts.append(f"{pipe['pipeline.schedule']}(m={pipe['pipeline.microbatches']}"
                     + (f",v={pipe['pipeline.virtual_stages']}"
                        if pipe['pipeline.schedule'] == "circular" else "") + ")")
    label = " ".join(parts) + (" tp_overlap" if tp_overlap else "") \
        + f" remat={remat} grad_accum={accum}"
    if offload[0]:
        label += " offload=optimizer" + ("+params" if offload[1] else "")
    return label


def _pipeline_options(pp: int, n_layers: int, schedules: tuple[str, ...] = ("gpipe", "1f1b")):
    """schedules: those the run's training takes (plan/training.py; LoRA: no 1f1b, it would
    compute the frozen base's weight gradients); circular always."""
    if pp == 1:
        yield {"pipeline.schedule": "gpipe", "pipeline.virtual_stages": 0,
               "pipeline.microbatches": 1}
        return
    for k in MICROBATCH_MULTIPLES:
        for schedule in schedules:
            yield {"pipeline.schedule": schedule, "pipeline.virtual_stages": 0,
                   "pipeline.microbatches": k * pp}
        for v in VIRTUAL_STAGES:
            if n_layers % (pp * v) == 0:
                yield {"pipeline.schedule": "circular", "pipeline.virtual_stages": v,
                       "pipeline.microbatches": k * pp}


def _context_options(tp: int, domain: int, max_context: int = 0):
    """(context degree, strategy): 1, then powers of two whose context x tensor group fits in
    one NVLink domain (and, when max_context is set, up to it), each with every strategy."""
    yield 1, "ring"
    cp = 2
    while tp * cp <= domain and (not max_context or cp <= max_context):
        for strategy in CONTEXT_STRATEGIES:
            yield cp, strategy
        cp *= 2


def _meshes(cluster: Cluster, max_context: int):
    """(tensor, (context, strategy), pipeline, the rest for data x fsdp (x expert)) that tile
    the cluster."""
    n, domain = cluster.n_gpus, cluster.nvlink_domain
    for tp in (t for t in _divisors(domain) if t <= 8):
        for cp, strategy in _context_options(tp, domain, max_context):
            for pp in (p for p in _divisors(n // (tp * cp)) if p <= 16):
                yield tp, (cp, strategy), pp, n // (tp * cp * pp)


def _expert_options(cfg: Config, rest: int) -> list[int]:
    """mesh.expert degrees: those dividing the devices left that the model's experts split
    into (1 only for a dense model)."""
    return [e for e in _divisors(rest) if cfg.model.splits_experts(e)]


def candidates(cfg: Config, cluster: Cluster, max_context: int = 0):
    training = plan_state(cfg).training
    offloads = training.offload_choices(OFFLOADS)  # (nothing offloaded first)
    meshes = ((tp, context, pp, rest, ep) for tp, context, pp, rest in
              _meshes(cluster, max_context) for ep in _expert_options(cfg, rest))
    for tp, context, pp, rest, ep in meshes:
        for fsdp, remat, accum, offload in itertools.product(
                _divisors(rest // ep), REMATS, GRAD_ACCUMS, offloads):
            for pipe in _pipeline_options(pp, cfg.model.n_layers, training.pipeline_schedules):
                dp = rest // (ep * fsdp)
                overlap = _tp_overlap(cfg, tp, pp, pipe["pipeline.schedule"])
                label = _label(tp, pp, dp, fsdp, remat, accum, pipe, offload, context,
                               overlap, ep)
                overrides = {"execution.tp_overlap": overlap, "mesh.tensor": tp,
                             "mesh.pipeline": pp, "mesh.fsdp": fsdp, "mesh.data": dp,
                             "mesh.expert": ep, "mesh.context": context[0],
                             "execution.context_strategy": context[1], "execution.remat": remat,
                             "train.grad_accum": accum, "train.offload_optimizer": offload[0],
                             "train.offload_params": offload[1], **pipe}
                if (pp > 1 or context[0] > 1) and not _runs_in_shard_map(
                        cfg.execution.attention_impl):
                    # e.g. JAX's cuDNN attention cannot be partitioned inside the shard_map
                    # of a pipeline stage or of the context K/V exchange (custom_partitioning
                    # fails to compile); 'auto' picks a flash kernel there and is what such a
                    # run would use.
                    overrides["execution.attention_impl"] = "auto"
                    label += " attention=auto"
                yield label, overrides


def _tp_overlap(cfg: Config, tp: int, pp: int, schedule: str) -> bool:
    """execution.tp_overlap for a candidate: on wherever there is a tensor ring and the config
    accepts it. The config's refusals that do not depend on the candidate's schedule (FP8
    recipes) come from config.tp_overlap_unsupported itself; the 1f1b one is the schedule's."""
    if tp == 1 or (pp > 1 and schedule == "1f1b") or cfg.model.tp_overlap_refusal():
        return False
    return tp_overlap_unsupported(cfg, {"tensor": tp, "pipeline": 1}) is None


def _runs_in_shard_map(attention_impl: str) -> bool:
    """Whether the attention backend compiles inside a pipeline stage's jax.shard_map (the
    backend table's capability; 'auto' chooses one that does)."""
    b = ATTENTION_BACKENDS.get(attention_impl)
    return b is None or b.in_shard_map


def search(cfg: Config, cluster: Cluster, max_context: int = 0
           ) -> tuple[list[Candidate], list[Candidate]]:
    """(fitting candidates, fastest first; dropped candidates with their reasons).
    max_context: the largest mesh.context tried (0: what the NVLink domain allows)."""
    from titanax.config import apply_overrides

    kept, dropped = [], []
    for label, overrides in candidates(cfg, cluster, max_context):
        try:
            c_cfg = apply_overrides(cfg, overrides)
            layout = layout_for(c_cfg, cluster)
        except ConfigError as e:
            dropped.append(Candidate(cfg, label, dropped=f"invalid: {e}"))
            continue
        est = estimate(c_cfg, cluster, layout)
        cand = Candidate(c_cfg, label, est)
        if not est.fits:
            cand.dropped = (f"does not fit: {est.memory['total'] / 1e9:.1f} GB per device > "
                            f"{est.usable_memory_bytes / 1e9:.1f} GB usable")
            dropped.append(cand)
        else:
            kept.append(cand)
    # Ties (same predicted speed) go to the plan with more memory to spare.
    kept.sort(key=lambda c: (-round(c.estimate.tokens_per_s_per_gpu, 1),
                             c.estimate.memory["total"]))
    return kept, dropped


def dropped_summary(dropped: list[Candidate]) -> dict[str, int]:
    """How many candidates each kind of reason dropped ('does not fit', 'invalid: FIELD')."""
    out: dict[str, int] = {}
    for c in dropped:
        head, _, rest = c.dropped.partition(": ")
        kind = f"{head}: {rest.partition(':')[0]}" if head == "invalid" else head
        out[kind] = out.get(kind, 0) + 1
    return out
