"""Timing one jitted call: the median over iters after warm-up calls (compile included there)."""

from __future__ import annotations

import statistics
import time

import jax


def median_call_seconds(fn, args, iters: int, *, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)
