"""How far the planner's tokens/s can be trusted: the published Llama-3-70B training runs it can
be set beside (docs/planner.md, "Public Llama-3-70B results beside the planner"), each planned
with the cost model on its own hardware and layout, and the spread of published / predicted.

A prediction is then printed with that spread (`uncertainty`): published runs have come out
between `low` and `high` times what the model predicted for them. The rows are planned afresh
each time (cost model only, milliseconds), so the spread follows every change to the model.
"""

from __future__ import annotations

import dataclasses
import functools

from titanax.config import load_config
from titanax.plan.cluster import Cluster, layout_for, plan_config
from titanax.plan.cost_model import estimate

CONFIG = "configs/llama3_70b.py"


# `duplicates` pairs this record with plan/preset_audit.py's Cell: typed fields alike in
# shape only, different records, no logic to share.
@dataclasses.dataclass(frozen=True)
class Published:
    run: str
    gpu: str
    nodes: int
    tokens_per_s_per_gpu: float  # as published
    overrides: tuple  # --set flags on configs/llama3_70b.py that plan its layout


PUBLISHED = (
    Published("NeMo, 64x H100 BF16 (TP 4, PP 4, CP 2, VP 5, GBS 128)", "h100", 8, 1113.0, (
        "train.batch_size=128", "mesh.tensor=4", "mesh.pipeline=4", "mesh.fsdp=2",
        "mesh.context=2", "mesh.data=1", "pipeline.schedule=circular",
        "pipeline.virtual_stages=5", "pipeline.microbatches=32", "execution.attention_impl=auto",
        "execution.tp_overlap=true")),
    Published("MaxText, 128x H100 BF16 (FSDP 128, GBS 256)", "h100", 16, 1052.0, ()),
    Published("Together AI (TorchTitan, FSDP), 8x B200 BF16", "b200", 1, 1908.0,
              ("train.batch_size=16",)),
)


@functools.cache
def uncertainty() -> dict:
    """{'low', 'high', 'rows': [{run, published, predicted, ratio}]}: published / predicted
    tokens/s per GPU over PUBLISHED."""
    from pallas_kernels import aot

    rows = []
    for p in PUBLISHED:
        cluster = Cluster(p.gpu, p.nodes)
        # (at the runs' own grad_accum 1, not the preset's auto)
        cfg = plan_config(load_config(aot.REPO / CONFIG, ["train.grad_accum=1", *p.overrides]),
                          cluster)
        predicted = estimate(cfg, cluster, layout_for(cfg, cluster)).tokens_per_s_per_gpu
        rows.append({"run": p.run, "published": p.tokens_per_s_per_gpu,
                     "predicted": predicted, "ratio": p.tokens_per_s_per_gpu / predicted})
    ratios = [r["ratio"] for r in rows]
    return {"low": min(ratios), "high": max(ratios), "rows": rows}


def describe(tokens_per_s: float, u: dict) -> str:
    """'2,597 (published runs came in at 0.92x-1.34x the model's figure for them:
    2,390-3,480)'."""
    return (f"{tokens_per_s:,.0f} tokens/s per GPU; published 70B runs came in at "
            f"{u['low']:.2f}x-{u['high']:.2f}x the model's figure for them, so "
            f"{tokens_per_s * u['low']:,.0f}-{tokens_per_s * u['high']:,.0f}")
