"""The optim section: AdamW's hyperparameters and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.errors import check_choice, check_positive, check_types, fail

LR_SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3
    warmup_steps: int = 30
    # > 0: the warmup is this share of the decay steps (train.steps unless optim.decay_steps),
    # in place of warmup_steps, so it follows a train.steps given later (MaxText's
    # warmup_steps_fraction; the fine-tuning recipe of launch.import_hf takes 3%).
    warmup_fraction: float = 0.0
    schedule: str = "cosine"
    decay_steps: int = 0  # 0: train.steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # 0: no clipping

    def __post_init__(self):
        check_types("optim", self)
        check_positive("optim", self, "lr", "eps")
        check_choice("optim.schedule", self.schedule, LR_SCHEDULES)
        for name in ("warmup_steps", "decay_steps", "weight_decay", "clip_norm"):
            if getattr(self, name) < 0:
                fail(f"optim.{name}", f"must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail("optim.min_lr_ratio", f"must lie in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.warmup_fraction < 1.0:
            fail("optim.warmup_fraction", f"must lie in [0, 1), got {self.warmup_fraction}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                fail(f"optim.{name}", f"must lie in [0, 1), got {getattr(self, name)}")
