"""The optim section: AdamW's hyperparameters and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.errors import check_choice, check_positive, check_types, fail

LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
# wsd's decay over its last decay_fraction: factor(p) of the progress p in [0, 1] through it
# (TorchTitan's decay_type; sqrt is 1 - sqrt(p)). train/optim.py holds the formulas.
DECAY_SHAPES = ("linear", "cosine", "sqrt")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-3  # peak learning rate (AdamW), reached after the warmup
    warmup_steps: int = 30  # linear warmup from lr/warmup_steps to lr
    # > 0: the warmup is this share of the decay steps (train.steps unless optim.decay_steps),
    # in place of warmup_steps, so it follows a train.steps given later (MaxText's
    # warmup_steps_fraction; the fine-tuning recipe of launch.import_hf takes 3%).
    warmup_fraction: float = 0.0
    schedule: str = "cosine"  # the lr after warmup: cosine, linear, constant or wsd
    # The schedule's horizon: the step it ends at (lr * min_lr_ratio from there on). 0:
    # train.steps, so a resume with more train.steps stretches the curve (the run log says
    # so); a fixed number keeps the curve whatever train.steps becomes.
    decay_steps: int = 0
    # wsd only (warmup-stable-decay, MiniCPM / TorchTitan): lr holds after the warmup and
    # decays over the horizon's last decay_fraction, with the decay_shape curve.
    decay_fraction: float = 0.2
    decay_shape: str = "linear"  # wsd's decay curve: linear, cosine or sqrt
    min_lr_ratio: float = 0.1  # the lr at the horizon's end, as a share of lr
    weight_decay: float = 0.1  # decoupled (AdamW); norm scales get none (ModelSpec.no_decay)
    b1: float = 0.9  # Adam's first-moment decay
    b2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # added to the second moment's root
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
        self._check_wsd_fields()
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                fail(f"optim.{name}", f"must lie in [0, 1), got {getattr(self, name)}")

    def _check_wsd_fields(self) -> None:
        check_choice("optim.decay_shape", self.decay_shape, DECAY_SHAPES)
        if not 0.0 < self.decay_fraction <= 1.0:
            fail("optim.decay_fraction", f"must lie in (0, 1], got {self.decay_fraction}")
        if self.schedule == "wsd":
            return
        # A wsd field set under another schedule would be silently ignored: say so instead.
        defaults = OptimConfig.__dataclass_fields__
        for name in ("decay_fraction", "decay_shape"):
            if getattr(self, name) != defaults[name].default:
                fail(f"optim.{name}", f"applies only to optim.schedule=wsd (the schedule is "
                     f"{self.schedule!r}): set optim.schedule=wsd or leave optim.{name} at "
                     f"{defaults[name].default!r}")
