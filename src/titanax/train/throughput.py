"""Throughput accounting: tokens/s over the intervals between logged steps, the peak FLOP/s
per device MFU divides by, and the FLOP formula it multiplies by.

FLOPs per token = 6*N + 12*L*d*S: N the parameters without the input embedding (the output
layer counts), L layers, d model width, S sequence length; the second term is attention's
score and value matmuls (forward + backward, causal mask not discounted), as NVIDIA and MaxText
report MFU. MFU = tokens/s * FLOPs per token / (devices * peak FLOP/s per device).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from titanax.hardware import lookup_device

# The formula lives with the model specs (models/spec.py); re-exported for the loop, the
# planner and the benchmarks, which report MFU with it.
from titanax.models.spec import FLOP_FORMULA, flops_per_token  # noqa: F401


def measure_matmul_peak(n: int = 2048, repeats: int = 5, devices=None) -> float:
    """FLOP/s of one large float32 matmul through XLA on one device (the CPU probe): the best of
    a few runs, so the measured peak is what this machine's XLA can do, not a datasheet."""
    device = (devices or jax.devices())[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def peak_flops_per_device(configured: float, compute_dtype: str) -> tuple[float, str]:
    """(peak FLOP/s per device, where it came from)."""
    if configured > 0:
        return configured, "train.peak_flops"
    dev = jax.devices()[0]
    hw = lookup_device(getattr(dev, "device_kind", ""))
    if hw is not None:
        return hw.bf16_flops, f"{hw.name} datasheet (dense bf16)"
    if dev.platform == "cpu":
        # All simulated CPU devices share the same cores: the probe measures the whole machine,
        # so each device's share is the probe divided by the device count.
        total = measure_matmul_peak()
        return total / jax.device_count(), f"CPU matmul probe {total / 1e9:.1f} GFLOP/s"
    return 0.0, f"unknown device kind {dev.device_kind!r}: set train.peak_flops"


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
