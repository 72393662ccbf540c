"""A mixture-of-experts step in the planner (config/moe.py MoEModelConfig; docs/moe.md,
Planner): the experts' GEMMs on the active parameters, and expert parallelism's dispatch
(models/common/moe_ep.py), whose all-to-alls comm_model.expert_comm times and whose buffers
memory_model counts.

With mesh.expert = ep > 1 each MoE layer, on each device, for its T tokens of one
(accumulation, pipeline) microbatch (T x K (token, expert) pairs), sends a [ep, C, D] buffer
of rows in the compute dtype by all_to_all to the experts' devices with an int32 [ep, C] of
their local expert ids, and gets the experts' [ep, C, D] results back by a second all_to_all.
C = moe_ep.capacity(T x K, ep, execution.expert_capacity_factor or None): T x K when dropless
(room for every pair on one destination, so each buffer is ep times the pairs), else
ceil(factor x T x K / ep). Of each buffer (ep - 1) / ep leaves the device. The backward sends
the two row buffers' cotangents back the same way (the ids have none); a remat policy that
recomputes the layer (comm_model.RECOMPUTING_REMATS) runs the forward's three again.
"""

from __future__ import annotations

import dataclasses

from titanax.config import Config
from titanax.config.moe import MoEModelConfig
from titanax.models.common.moe_ep import AXIS, capacity
from titanax.models.common.moe_hooks import inactive_expert_params
from titanax.plan.step_shape import StepShape

EXPERT_AXIS = AXIS  # the mesh axis the experts split over and the all-to-alls run on
# Each (token, expert) pair's D-wide row is copied this many times per forward by the dispatch
# (written and read: the sorted copy, the gather into the experts' order, the results'
# scatter back to pair order, the gate-weighted sum into its token), beside the SwiGLU's own
# traffic; HBM-bound, counted in compute_model.elementwise_seconds.
DISPATCH_ROW_COPIES = 4


def is_moe(cfg: Config) -> bool:
    return isinstance(cfg.model, MoEModelConfig)


def active_layer_params(cfg: Config, n_no_embed: int) -> int:
    """The parameters a token runs through (without the input embedding): all of a dense
    model's, an MoE's less the experts it is not routed to (what ModelSpec.flops counts)."""
    return n_no_embed - inactive_expert_params(cfg.model) if is_moe(cfg) else n_no_embed


def elementwise_values_per_token(cfg: Config) -> float:
    """Values per token and layer one forward of the feed-forward moves besides its GEMMs:
    SwiGLU on 3 ffn_dim (an MoE: for each of its K experts), and the MoE dispatch's copies of
    the pairs' rows (DISPATCH_ROW_COPIES, read and written)."""
    m = cfg.model
    if not is_moe(cfg):
        return 3 * m.ffn_dim
    k = m.experts_per_token
    return 3 * k * m.ffn_dim + 2 * DISPATCH_ROW_COPIES * k * m.d_model


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """One MoE layer's expert-parallel exchange on one device, per microbatch."""
    ep: int  # mesh.expert
    tokens: int  # T: this device's tokens of one (accumulation, pipeline) microbatch
    pairs: int  # T x K
    rows: int  # C: rows per destination
    factor: float  # execution.expert_capacity_factor (0: dropless)
    d_model: int
    act_bytes: int

    @property
    def buffer_bytes(self) -> float:
        """One [ep, C, D] buffer in the compute dtype."""
        return self.ep * self.rows * self.d_model * self.act_bytes

    @property
    def ids_bytes(self) -> float:
        """The int32 [ep, C] local expert ids sent with the rows."""
        return self.ep * self.rows * 4

    @property
    def sent_share(self) -> float:
        """Of a buffer, what leaves the device: all but the block for itself."""
        return (self.ep - 1) / self.ep


def dispatch(cfg: Config, shape: StepShape) -> Dispatch | None:
    """The exchange of cfg's MoE layers on this layout; None without expert parallelism."""
    ep = shape.deg.get(EXPERT_AXIS, 1)
    if not is_moe(cfg) or ep == 1:
        return None
    tokens = round(shape.tokens_pipe_micro)
    pairs = tokens * cfg.model.experts_per_token
    factor = cfg.execution.expert_capacity_factor
    return Dispatch(ep, tokens, pairs, capacity(pairs, ep, factor or None), factor,
                    cfg.model.d_model, shape.act_bytes)


def all_to_alls_per_layer(cfg: Config, recomputes: bool) -> tuple[int, int]:
    """(row-buffer all_to_alls, id all_to_alls) one MoE layer runs per microbatch: the
    forward's two and one, the backward's two, and the forward's again when recomputed."""
    forwards = 2 if recomputes else 1
    return 2 * forwards + 2, forwards


def all_to_all_bytes(cfg: Config, shape: StepShape, recomputes: bool) -> tuple[float, int]:
    """(bytes one device sends per step, all_to_all calls per step) of expert parallelism:
    per layer and microbatch, (ep - 1)/ep of every buffer, x L/pp layers x accum x micro."""
    d = dispatch(cfg, shape)
    if d is None:
        return 0.0, 0
    rows, ids = all_to_alls_per_layer(cfg, recomputes)
    runs = cfg.model.n_layers / shape.deg["pipeline"] * shape.accum * shape.micro
    per_layer = d.sent_share * (rows * d.buffer_bytes + ids * d.ids_bytes)
    return runs * per_layer, int(runs * (rows + ids))


def dispatch_buffer_bytes(cfg: Config, shape: StepShape) -> float:
    """HBM of one layer's exchange at its smallest: the send and receive buffers of one
    all_to_all, live together (the dispatch's other copies and their gradients come on top:
    a lower bound)."""
    d = dispatch(cfg, shape)
    return 0.0 if d is None else 2 * d.buffer_bytes


def expert_rows(cfg: Config, shape: StepShape) -> float:
    """Rows one device's experts run per layer and microbatch: its tokens' T x K pairs, or with
    expert parallelism the ep x C rows received (empty slots included: the grouped GEMMs'
    outputs have every row)."""
    d = dispatch(cfg, shape)
    return shape.tokens_pipe_micro * cfg.model.experts_per_token if d is None else d.ep * d.rows


def layer_transient_bytes(cfg: Config, shape: StepShape, one_layer: float) -> float:
    """memory_model's one-layer backward transient for an MoE layer, fitted to the compiled
    buffers of a 2-layer Qwen3-30B-A3B step on 8 H100s (`launch.plan --set model.n_layers=2
    --buffers 40`, docs/moe.md), over the experts' rows (expert_rows):
    - six [rows, d_model] buffers: the gathered rows (the forward's recompute and the
      backward's), the down projection's output and gradient, the combine's broadcast and its
      transpose's sum (8.6 GB each there: 52 GB of the 89 GB peak);
    - six [rows, ffn_dim / tensor] ones (gate, up, product, their gradients), as the dense
      formula has;
    - per token four [tokens, d_model] buffers (normed input, q, attention output, incoming
      gradient) and the router's float32 input and its gradient;
    - two layers' parameters gathered over the FSDP group in the compute dtype (`one_layer`:
      one layer's, with the experts; one prefetched)."""
    m, act = cfg.model, shape.act_bytes
    rows = expert_rows(cfg, shape)
    return (rows * (6 * m.d_model + 6 * m.ffn_dim / shape.deg["tensor"]) * act
            + shape.tokens_pipe_micro * (4 * m.d_model * act / shape.deg["tensor"]
                                         + 2 * m.d_model * 4)
            + 2 * one_layer * act)


def dispatch_json(cfg: Config, shape: StepShape) -> dict | None:
    """plan.json's "expert_parallel": the exchange's shapes and what they cost."""
    d = dispatch(cfg, shape)
    if d is None:
        return None
    out = {"expert": d.ep, "tokens_per_device": d.tokens, "pairs_per_device": d.pairs,
           "rows_per_destination": d.rows, "capacity_factor": d.factor,
           "buffer_bytes": d.buffer_bytes, "dropless": not d.factor}
    if not d.factor:
        out["advice"] = (
            f"dropless: each [expert={d.ep}, C={d.rows:,}, D={d.d_model}] all-to-all buffer "
            f"holds room for every pair on one destination, {d.ep} x the {d.pairs:,} pairs "
            f"({d.buffer_bytes / 1e9:.2f} GB); --set execution.expert_capacity_factor=1.25 "
            f"bounds C to ceil(1.25 T K / {d.ep}) = {capacity(d.pairs, d.ep, 1.25):,} rows "
            "(pairs past it are dropped)")
    return out
