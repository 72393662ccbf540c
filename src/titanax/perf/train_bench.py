"""Measures the compiled train step: compile time, steady-state step time, tokens/s, achieved
FLOP/s and MFU against a matmul peak measured in the same process, and memory.

FLOPs per step = (6*N + 12*L*d*S) * tokens, N the parameters without the input embedding
(train/metrics.py), the same formula the PyTorch peer (shared/bench/hf_torch_train.py) uses.
Batches are random tokens made before timing starts: data loading is not measured.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from titanax.config import Config
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import batch_input_spec, model_context
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.resolved import resolve
from titanax.train.state import create_train_state, jit_train_step
from titanax.train.throughput import measure_matmul_peak


@dataclasses.dataclass
class TrainBenchResult:
    config: dict
    devices: int
    params: int
    flops_per_step: float
    compile_s: float
    step_times_s: list[float]
    step_median_s: float
    step_p10_s: float
    step_p90_s: float
    tokens_per_s: float
    achieved_flops: float  # FLOP/s, all devices together
    peak_flops: float  # FLOP/s, all devices together (the probe, or train.peak_flops x devices)
    mfu: float
    argument_bytes_per_device: int
    temp_bytes_per_device: int
    max_rss_bytes: int
    final_loss: float

    def row(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("step_times_s")
        d.pop("config")
        return d


def _random_batches(cfg: Config, n: int, sharding) -> list[dict]:
    rng = np.random.default_rng(cfg.train.seed)
    B, S = cfg.train.batch_size, cfg.train.seq_len
    out = []
    for _ in range(n):
        toks = rng.integers(0, cfg.model.vocab_size, (B, S + 1), dtype=np.int32)
        batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
                 "segment_ids": np.ones((B, S), np.int32),
                 "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (B, S)).copy()}
        out.append({k: jax.device_put(v, sharding) for k, v in batch.items()})
    return out


def _build(cfg: Config, devices, n_batches: int):
    """The real train step as train/loop.py builds it, its state and random device batches,
    and the model's spec (resolved once here)."""
    mesh = build_mesh(cfg.mesh, devices)
    spec = resolve(cfg).spec
    tx = make_optimizer(cfg, no_decay=spec.no_decay)
    graphdef, state, shardings = create_train_state(cfg, mesh, tx, spec=spec)
    step_fn = jit_train_step(cfg, mesh, graphdef, shardings, tx, lr_schedule(cfg), spec=spec)
    batch_sharding = NamedSharding(mesh, batch_input_spec())
    return mesh, step_fn, state, _random_batches(cfg, n_batches, batch_sharding), spec


def compile_seconds(cfg: Config, devices=None) -> tuple[float, object]:
    """(seconds to lower + compile the train step, its memory analysis); nothing runs."""
    mesh, step_fn, state, batches, _ = _build(cfg, list(devices or jax.devices()), 1)
    with model_context(mesh):
        t0 = time.perf_counter()
        compiled = step_fn.lower(state, batches[0]).compile()
        return time.perf_counter() - t0, compiled.memory_analysis()


def bench_train_step(cfg: Config, *, steps: int = 10, warmup: int = 2, devices=None,
                     peak_flops: float | None = None) -> TrainBenchResult:
    devices = list(devices or jax.devices())
    mesh, step_fn, state, batches, spec = _build(cfg, devices, min(4, steps + warmup))
    with model_context(mesh):
        t0 = time.perf_counter()
        compiled = step_fn.lower(state, batches[0]).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        times, metrics = [], None
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, batches[i % len(batches)])
            jax.block_until_ready(metrics)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    n_no_embed = spec.count_params(cfg.model, exclude_embedding=True)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    flops_step = spec.flops(cfg.model, cfg.train.seq_len, n_no_embed) * tokens
    if peak_flops is None:
        # The whole machine's matmul peak: simulated CPU devices share the same cores.
        peak_flops = (cfg.train.peak_flops * len(devices) if cfg.train.peak_flops
                      else measure_matmul_peak(devices=devices))
    med = statistics.median(times)
    qs = np.percentile(times, [10, 90])
    return TrainBenchResult(
        config=cfg.to_dict(), devices=len(devices), params=spec.count_params(cfg.model),
        flops_per_step=flops_step, compile_s=compile_s, step_times_s=times,
        step_median_s=med, step_p10_s=float(qs[0]), step_p90_s=float(qs[1]),
        tokens_per_s=tokens / med, achieved_flops=flops_step / med, peak_flops=peak_flops,
        mfu=flops_step / med / peak_flops if peak_flops else 0.0,
        argument_bytes_per_device=int(getattr(mem, "argument_size_in_bytes", 0) or 0),
        temp_bytes_per_device=int(getattr(mem, "temp_size_in_bytes", 0) or 0),
        max_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        final_loss=float(metrics["loss"]))
