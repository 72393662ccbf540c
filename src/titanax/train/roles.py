"""The role table of the train state's variables (train/state.py's module docstring has it in
full): variable type -> role, one run's table from its config and model spec. Apart from
train/state.py so the step (train/step.py) reads it without importing the state module, which
jits the step."""

from __future__ import annotations

import dataclasses
import enum

from flax import nnx

from titanax.config import Config
from titanax.models.common.lora import DROPOUT_KEYS, LoRA, dropout_token_keys
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
    own sets (models/spec.py SelfUpdated: an MoE's routing bias; None when there are none);
    `dropout_seed` the seed of the trained role's dropout masks (LoRA's adapter dropout:
    train.seed; None: the step draws none)."""
    by_type: tuple[tuple[type, Role], ...]
    trains: Role
    self_updated: SelfUpdated | None = None
    dropout_seed: int | None = None

    @property
    def types(self) -> tuple[type, ...]:
        return tuple(t for t, _ in self.by_type)

    @property
    def keeps_frozen_base(self) -> bool:
        """Does the run hold weights fixed beside what it trains (a LoRA run's base)?"""
        return any(role is Role.FROZEN for _, role in self.by_type)

    def step_inputs(self, batch: dict, step) -> dict:
        """The batch the train step's loss reads: with dropout, plus each token's dropout
        key (from dropout_seed and the step, so a resumed run draws the masks an
        uninterrupted one does; split into microbatches with the rows)."""
        if self.dropout_seed is None:
            return batch
        B, S = batch["inputs"].shape
        return {**batch, DROPOUT_KEYS: dropout_token_keys(self.dropout_seed, step, B, S)}


def roles_for(cfg: Config, spec: ModelSpec) -> Roles:
    """THE table (train/state.py's module docstring). spec: cfg.model's (train/resolved.py)."""
    lora = cfg.lora.enabled
    return Roles(by_type=((nnx.Param, Role.FROZEN if lora else Role.TRAINED),
                          (LoRA, Role.ADAPTER), (Fp8Meta, Role.STATISTIC)),
                 trains=Role.ADAPTER if lora else Role.TRAINED,
                 # under LoRA a routing bias is part of the frozen base
                 self_updated=None if lora else spec.self_updated(cfg.model),
                 dropout_seed=cfg.train.seed if lora and cfg.lora.dropout > 0 else None)
