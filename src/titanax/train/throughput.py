"""Tokens/s over the intervals between logged steps."""

from __future__ import annotations

import time

import numpy as np


class Throughput:
    """The interval since the last logged step: its tokens/s and time per step. The first
    interval includes compilation and is kept out of the run's mean; evaluation is not
    training throughput, so the clock restarts after it."""

    def __init__(self, start_step: int, tokens_per_step: int):
        self.start_step, self.tokens_per_step = start_step, tokens_per_step
        self.t_last, self.step_last = time.perf_counter(), start_step
        self.rates = []

    def interval(self, step: int) -> tuple[float, float, float]:
        """(tokens/s, seconds per step, now) since the last call; starts the next interval."""
        now = time.perf_counter()
        tps = (step - self.step_last) * self.tokens_per_step / (now - self.t_last)
        if self.step_last > self.start_step:
            self.rates.append(tps)
        step_time = (now - self.t_last) / (step - self.step_last)
        self.t_last, self.step_last = now, step
        return tps, step_time, now

    def restart_clock(self) -> None:
        self.t_last = time.perf_counter()

    def mean(self) -> float:
        return float(np.mean(self.rates)) if self.rates else 0.0
