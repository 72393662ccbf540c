"""The abstract train state the planner reads, built once per model and lora section (one
nnx.eval_shape of the model with its adapters: nothing allocated), its variables grouped by
role as the run's role table splits them (train/roles.py roles_for): parameter counts, the
weights' layout over the mesh (plan/param_layout.py), what the trained role counts
(plan/training.py: FullTraining, or plan/lora.py's AdapterTraining) and the architecture's
planner terms (models/spec.py PlannerTerms). This module is the planner's one ModelSpec
lookup; every layout of a config (`--search`) reuses the one PlanState."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from titanax.config import Config, ExecutionConfig
from titanax.models.spec import ModelSpec, PlannerTerms
from titanax.plan.lora import AdapterParams, AdapterTraining
from titanax.plan.param_layout import LeafLayout, ParamLeaf, UniformLayout
from titanax.plan.training import FullTraining
from titanax.train.roles import Role, Roles, roles_for

_CACHE_SIZE = 16
_CACHE: dict = {}


@dataclasses.dataclass(frozen=True)
class PlanState:
    spec: ModelSpec
    roles: Roles
    by_role: Mapping[Role, tuple[ParamLeaf, ...]]  # the abstract state's leaves per role
    n_params: int  # every weight (nnx.Param; FP8 scaling state and adapters are not)
    n_no_embed: int  # without the input embedding (tied: counted once, as the output layer)
    layout: UniformLayout | LeafLayout  # how the weights split over the mesh
    training: FullTraining | AdapterTraining  # what the trained role counts

    @property
    def terms(self) -> PlannerTerms:
        return self.spec.planner


def plan_state(cfg: Config) -> PlanState:
    """cfg's PlanState, built on first use for its (model, lora) sections."""
    key = (cfg.model, cfg.lora)
    got = _CACHE.get(key)
    if got is None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        got = _CACHE[key] = _build(cfg)
    return got


def _leaves(spec: ModelSpec, cfg: Config, roles: Roles) -> dict[Role, tuple[ParamLeaf, ...]]:
    """{role: its variables' shapes, logical axes and widths}, from the model's build under
    nnx.eval_shape, split by the role table's variable types."""
    from flax import nnx

    from titanax.parallel.mesh import single_device_mesh
    from titanax.parallel.rules import model_context

    with model_context(single_device_mesh()):
        abstract = nnx.eval_shape(lambda: spec.build(cfg.model, ExecutionConfig(),
                                                     rngs=nnx.Rngs(0), lora=cfg.lora))
    _, *groups = nnx.split(abstract, *roles.types)
    return {role: tuple(ParamLeaf(tuple(str(p) for p in path), tuple(v.shape),
                                  tuple(v.get_metadata()["out_sharding"]), v.dtype.itemsize)
                        for path, v in nnx.to_flat_state(group))
            for (_, role), group in zip(roles.by_type, groups, strict=True)}


# The training kind by the role the optimizer moves (train/roles.py's table decides it).
_TRAINING = {Role.TRAINED: lambda cfg, by_role: FullTraining(),
             Role.ADAPTER: lambda cfg, by_role: AdapterTraining(
                 AdapterParams.of(by_role[Role.ADAPTER], cfg.model.n_layers),
                 max(x.itemsize for x in by_role[Role.ADAPTER]))}


def _build(cfg: Config) -> PlanState:
    from titanax.models.registry import model_spec

    spec = model_spec(cfg.model)
    roles = roles_for(cfg, spec)
    by_role = _leaves(spec, cfg, roles)
    m = cfg.model
    weights = by_role[roles.by_type[0][1]]  # nnx.Param's group: the table's first
    n_params = sum(x.size for x in weights)
    n_no_embed = n_params - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
    layout = (UniformLayout(m, n_params) if spec.planner.params_split_alike
              else LeafLayout(weights, m.n_layers))
    return PlanState(spec, roles, by_role, n_params, n_no_embed, layout,
                     _TRAINING[roles.trains](cfg, by_role))

