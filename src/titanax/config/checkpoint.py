"""The checkpoint section: how often, how many, and where a run starts from."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.errors import check_positive, check_types, fail


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 100  # 0: only at the end
    keep: int = 3  # the newest steps kept (older ones deleted; permanent_every ones stay)
    async_save: bool = True  # write checkpoints in the background while training goes on
    restore: str = ""  # another run's workdir, checkpoints/ folder or step folder to start from
    permanent_every: int = 0  # also keep every step divisible by this for good; 0: off

    def __post_init__(self):
        check_types("checkpoint", self)
        if self.every_steps < 0:
            fail("checkpoint.every_steps", "must be >= 0 (0: only at the end)")
        check_positive("checkpoint", self, "keep")
        if self.permanent_every < 0:
            fail("checkpoint.permanent_every", "must be >= 0 (0: off)")
        if self.permanent_every and self.every_steps and self.permanent_every % self.every_steps:
            fail("checkpoint.permanent_every", f"{self.permanent_every} is not a multiple of "
                 f"checkpoint.every_steps={self.every_steps}, so those steps are never saved")
