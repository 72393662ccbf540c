"""The role table of the train state's variables (train/state.py's module docstring has it in
full): variable type -> role, one run's table from its config and model spec. Apart from
train/state.py so the step (train/step.py) reads it without importing the state module, which
jits the step."""

from __future__ import annotations

import dataclasses
import enum

from flax import nnx

from titanax.config import Config
from titanax.models.common.lora import LoRA
from titanax.models.registry import model_spec
from titanax.models.spec import ModelSpec, SelfUpdated
from titanax.ops.linear import Fp8Meta


class Role(enum.Enum):
    TRAINED = "trained"  # moved by the optimizer
    FROZEN = "frozen"  # held fixed: a LoRA run's base weights
    ADAPTER = "adapter"  # LoRA's adapters: moved by the optimizer, beside a frozen base
    STATISTIC = "statistic"  # set by a rule of its own from the step (fp8_delayed's histories)


# The roles whose variables the step differentiates and the optimizer moves.
OPTIMIZED = (Role.TRAINED, Role.ADAPTER)


@dataclasses.dataclass(frozen=True)
class Roles:
    """One run's role table: variable type -> role, in the order the model is split by;
    `trains` the role the optimizer moves; `self_updated` the trained leaves a rule of their
    own sets (models/spec.py SelfUpdated: an MoE's routing bias; None when there are none)."""
    by_type: tuple[tuple[type, Role], ...]
    trains: Role
    self_updated: SelfUpdated | None = None

    @property
    def types(self) -> tuple[type, ...]:
        return tuple(t for t, _ in self.by_type)


def roles_for(cfg: Config, spec: ModelSpec | None = None) -> Roles:
    """THE table (train/state.py's module docstring). spec: cfg.model's (looked up when not given)."""
    spec = spec or model_spec(cfg.model)
    lora = cfg.lora.enabled
    return Roles(by_type=((nnx.Param, Role.FROZEN if lora else Role.TRAINED),
                          (LoRA, Role.ADAPTER), (Fp8Meta, Role.STATISTIC)),
                 trains=Role.ADAPTER if lora else Role.TRAINED,
                 # under LoRA a routing bias is part of the frozen base
                 self_updated=None if lora else spec.self_updated(cfg.model))
