"""Steps skipped for a non-finite loss, gradient or FP8 amax: counted for the whole run (the
counts travel in every checkpoint's run state) and fatal after train.max_bad_steps in a row."""

from __future__ import annotations

import jax


class TrainingDiverged(RuntimeError):
    """train.max_bad_steps consecutive steps had a non-finite loss, gradient or FP8 amax."""


class BadStepCounter:
    """Holds each step's metrics as device arrays until the loop next waits for the devices
    (a logging, evaluation or checkpoint step), then reads them all in one transfer, counts
    skipped steps and stops the run after too many in a row. Reading them every step would
    make the host wait for each step before dispatching the next."""

    def __init__(self, limit: int, run_state: dict):
        self.limit = limit
        self.total = int(run_state.get("skipped_steps", 0))
        self.streak = int(run_state.get("bad_streak", 0))
        # fp8_delayed: non-finite amaxes recorded (their steps are skipped too), whole run
        self.nonfinite_amax = int(run_state.get("fp8_nonfinite_amax", 0))
        self._pending = []  # (step, metrics) not looked at yet, in step order

    def push(self, step: int, metrics) -> None:
        self._pending.append((step, metrics))

    def flush(self) -> dict | None:
        """Reads the pending steps' metrics; returns the last one's on the host (None when
        none was pending). Raises TrainingDiverged at the step whose streak hits the limit."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        values = jax.device_get([m for _, m in pending])
        for (step, _), metrics in zip(pending, values):
            self._count(step, metrics)
        return values[-1]

    def _count(self, step: int, metrics: dict) -> None:
        self.nonfinite_amax += int(metrics.get("fp8_nonfinite_amax", 0))
        if int(metrics["skipped"]) == 0:
            self.streak = 0
            return
        self.total += 1
        self.streak += 1
        if self.streak >= self.limit:
            raise TrainingDiverged(
                f"{self.streak} consecutive steps (up to step {step}) had a non-finite loss, "
                f"gradient norm or fp8_delayed amax (train.max_bad_steps={self.limit}); their updates were skipped, "
                f"so the weights are those before step {step - self.streak + 1}. The model "
                "has diverged or the data is broken: lower optim.lr or raise optim.warmup_steps, "
                "check the data, and resume from the last checkpoint.")

    def state(self) -> dict:
        """The run state saved with a checkpoint; a resumed run starts from it."""
        return {"skipped_steps": self.total, "bad_streak": self.streak,
                "fp8_nonfinite_amax": self.nonfinite_amax}
