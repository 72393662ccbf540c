"""Expert parallelism's exchange in the planner (docs/moe.md, Planner): what the architecture's
dispatch (ModelSpec.planner.dispatch; a mixture of experts': models/common/moe_plan.py) sends
per step, which comm_model.expert_comm times, and the buffers memory_model counts. A model
without a dispatch (a dense decoder, or mesh.expert = 1) sends nothing here."""

from __future__ import annotations

from titanax.config import Config
from titanax.models.common.moe_ep import AXIS
from titanax.plan.state_shape import plan_state
from titanax.plan.step_shape import StepShape

EXPERT_AXIS = AXIS  # the mesh axis the experts split over and the all-to-alls run on


def dispatch(cfg: Config, shape: StepShape):
    """The architecture's exchange on this layout (models/spec.py PlannerTerms.dispatch), or
    None."""
    return plan_state(cfg).terms.dispatch(cfg, shape)


def all_to_all_bytes(cfg: Config, shape: StepShape, recomputes: bool) -> tuple[float, int]:
    """(bytes one device sends per step, all_to_all calls per step) of expert parallelism:
    per layer and microbatch, (ep - 1)/ep of every buffer, x L/pp layers x accum x micro."""
    d = dispatch(cfg, shape)
    if d is None:
        return 0.0, 0
    rows, ids = d.all_to_alls(recomputes)
    runs = cfg.model.n_layers / shape.deg["pipeline"] * shape.accum * shape.micro
    per_layer = d.sent_share * (rows * d.buffer_bytes + ids * d.ids_bytes)
    return runs * per_layer, int(runs * (rows + ids))


def dispatch_buffer_bytes(cfg: Config, shape: StepShape) -> float:
    """HBM of one layer's exchange at its smallest: the send and receive buffers of one
    all_to_all, live together (the dispatch's other copies and their gradients come on top:
    a lower bound)."""
    d = dispatch(cfg, shape)
    return 0.0 if d is None else 2 * d.buffer_bytes


def dispatch_json(cfg: Config, shape: StepShape) -> dict | None:
    """plan.json's "expert_parallel": the exchange's shapes and what they cost."""
    d = dispatch(cfg, shape)
    return None if d is None else d.to_json()
