"""The planner's terms of a mixture-of-experts decoder (ModelSpec.planner, models/spec.py
PlannerTerms; docs/moe.md, Planner): the experts' GEMMs on the active parameters, the
parameters split leaf by leaf, and expert parallelism's dispatch (models/common/moe_ep.py),
whose all-to-alls plan/comm_model.py times and whose buffers plan/memory_model.py counts.

With mesh.expert = ep > 1 each MoE layer, on each device, for its T tokens of one
(accumulation, pipeline) microbatch (T x K (token, expert) pairs), sends a [ep, C, D] buffer
of rows in the compute dtype by all_to_all to the experts' devices with an int32 [ep, C] of
their local expert ids, and gets the experts' [ep, C, D] results back by a second all_to_all.
C = moe_ep.capacity(T x K, ep, execution.expert_capacity_factor or None): T x K when dropless
(room for every pair on one destination, so each buffer is ep times the pairs), else
ceil(factor x T x K / ep). Of each buffer (ep - 1) / ep leaves the device. The backward sends
the two row buffers' cotangents back the same way (the ids have none); a remat policy that
recomputes the layer (plan/comm_model.RECOMPUTING_REMATS) runs the forward's three again.

`cfg` is the run's Config and `shape` plan/step_shape.StepShape, as PlannerTerms says.
"""

from __future__ import annotations

import dataclasses

from titanax.models.common.moe_ep import AXIS, capacity
from titanax.models.common.moe_hooks import inactive_expert_params
from titanax.models.spec import PlannerTerms

# Each (token, expert) pair's D-wide row is copied this many times per forward by the dispatch
# (written and read: the sorted copy, the gather into the experts' order, the results'
# scatter back to pair order, the gate-weighted sum into its token), beside the SwiGLU's own
# traffic; HBM-bound, counted in plan/compute_model.elementwise_seconds.
DISPATCH_ROW_COPIES = 4

# What a mixture-of-experts plan does not model yet (issue 37): said beside its numbers. What
# it does model (docs/moe.md, Planner): active-parameter GEMMs, the experts' state sharded over
# expert x fsdp x context x tensor, the all-to-alls on 'expert', expert in --search.
MOE_NOTE = ("mixture of experts: routing is taken as balanced (GEMM time, all-to-all sizes) "
            "and the grouped GEMMs at the dense GEMM efficiency; the MoE layer's transient "
            "buffers are sized from the dispatch's shapes, not fitted to a compile, and saved "
            "activations under a remat policy other than full use the dense formula: check "
            "the compiled memory")


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

    @staticmethod
    def all_to_alls(recomputes: bool) -> tuple[int, int]:
        """(row-buffer all_to_alls, id all_to_alls) one MoE layer runs per microbatch: the
        forward's two and one, the backward's two, and the forward's again when recomputed."""
        forwards = 2 if recomputes else 1
        return 2 * forwards + 2, forwards

    def to_json(self) -> dict:
        """plan.json's "expert_parallel": the exchange's shapes and what they cost."""
        out = {"expert": self.ep, "tokens_per_device": self.tokens,
               "pairs_per_device": self.pairs, "rows_per_destination": self.rows,
               "capacity_factor": self.factor, "buffer_bytes": self.buffer_bytes,
               "dropless": not self.factor}
        if not self.factor:
            out["advice"] = (
                f"dropless: each [expert={self.ep}, C={self.rows:,}, D={self.d_model}] "
                f"all-to-all buffer holds room for every pair on one destination, {self.ep} x "
                f"the {self.pairs:,} pairs ({self.buffer_bytes / 1e9:.2f} GB); --set "
                f"execution.expert_capacity_factor=1.25 bounds C to ceil(1.25 T K / {self.ep})"
                f" = {capacity(self.pairs, self.ep, 1.25):,} rows (pairs past it are dropped)")
        return out


@dataclasses.dataclass(frozen=True)
class MoEPlannerTerms(PlannerTerms):
    # the experts' w_gate, w_up, w_down [L, E, D, F] split over 'expert' too, the router
    # [L, D, E] not over tensor (plan/param_layout.py counts them leaf by leaf)
    params_split_alike: bool = False

    def active_params(self, cfg, n_no_embed: int) -> int:
        """All but the experts a token is not routed to (what ModelSpec.flops counts)."""
        return n_no_embed - inactive_expert_params(cfg.model)

    def ffn_elementwise_values(self, cfg) -> float:
        """SwiGLU on 3 ffn_dim for each of the K experts, and the dispatch's copies of the
        pairs' rows (DISPATCH_ROW_COPIES, read and written)."""
        m = cfg.model
        k = m.experts_per_token
        return 3 * k * m.ffn_dim + 2 * DISPATCH_ROW_COPIES * k * m.d_model

    def dispatch(self, cfg, shape) -> Dispatch | None:
        """The exchange of cfg's MoE layers on this layout; None without expert parallelism."""
        ep = shape.deg.get(AXIS, 1)
        if ep == 1:
            return None
        tokens = round(shape.tokens_pipe_micro)
        pairs = tokens * cfg.model.experts_per_token
        factor = cfg.execution.expert_capacity_factor
        return Dispatch(ep, tokens, pairs, capacity(pairs, ep, factor or None), factor,
                        cfg.model.d_model, shape.act_bytes)

    def expert_rows(self, cfg, shape) -> float:
        """Rows one device's experts run per layer and microbatch: its tokens' T x K pairs, or
        with expert parallelism the ep x C rows received (empty slots included: the grouped
        GEMMs' outputs have every row)."""
        d = self.dispatch(cfg, shape)
        return (shape.tokens_pipe_micro * cfg.model.experts_per_token if d is None
                else d.ep * d.rows)

    def layer_transient_bytes(self, cfg, shape, one_layer: float) -> float:
        """The one-layer backward transient of an MoE layer, fitted to the compiled buffers
        of a 2-layer Qwen3-30B-A3B step on 8 H100s (`launch.plan --set model.n_layers=2
        --buffers 40`, docs/moe.md), over the experts' rows (expert_rows):
        - six [rows, d_model] buffers: the gathered rows (the forward's recompute and the
          backward's), the down projection's output and gradient, the combine's broadcast and
          its transpose's sum (8.6 GB each there: 52 GB of the 89 GB peak);
        - six [rows, ffn_dim / tensor] ones (gate, up, product, their gradients), as the dense
          formula has;
        - per token four [tokens, d_model] buffers (normed input, q, attention output,
          incoming gradient) and the router's float32 input and its gradient;
        - two layers' parameters gathered over the FSDP group in the compute dtype
          (`one_layer`: one layer's, with the experts; one prefetched)."""
        m, act = cfg.model, shape.act_bytes
        rows = self.expert_rows(cfg, shape)
        return (rows * (6 * m.d_model + 6 * m.ffn_dim / shape.deg["tensor"]) * act
                + shape.tokens_pipe_micro * (4 * m.d_model * act / shape.deg["tensor"]
                                             + 2 * m.d_model * 4)
                + 2 * one_layer * act)

    def plan_json(self) -> dict:
        return {"moe_note": MOE_NOTE}


MOE_PLANNER = MoEPlannerTerms()
