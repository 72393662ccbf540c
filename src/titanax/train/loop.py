"""The training loop: data -> step -> metrics -> checkpoints. No model logic lives here.

Fault tolerance: a run resumes from its workdir's newest intact checkpoint (a damaged one is
reported and skipped), SIGTERM/SIGUSR1 save at the next step boundary and return normally,
and steps with a non-finite loss or gradient are skipped and counted. The train state holds no
RNG: the step has no dropout or sampling, so it is a pure function of (state, batch), and the
data order is fixed by train.seed plus the grain iterator position saved with every checkpoint.
A resumed run therefore logs the same losses, step for step, as one never interrupted.

The host runs ahead of the devices: it reads nothing back (metrics, the skipped-step flags, the
stop flag) except at logging, evaluation and checkpoint steps, where it waits for them anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from titanax.checkpoint.orbax_io import Checkpointer, resolve_restore_source
from titanax.config import Config, ConfigError, format_config
from titanax.data.pipeline import build_data
from titanax.models.registry import model_spec
from titanax.parallel.layer_order import reorder_restored
from titanax.parallel.mesh import build_mesh, describe_mesh
from titanax.parallel.rules import activation_spec, model_context
from titanax.train import metrics as M
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.preemption import PreemptionWatch
from titanax.train.state import abstract_train_state, create_train_state, jit_train_step
from titanax.train.step import make_eval_step


@dataclasses.dataclass
class RunResult:
    final_step: int
    losses: dict[int, float]  # logged train losses by step
    val_losses: dict[int, float]
    tokens_per_s: float  # mean over the logged intervals after the first
    workdir: pathlib.Path
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient, whole run
    preempted: bool = False  # stopped early by SIGTERM/SIGUSR1 after saving a checkpoint


class TrainingDiverged(RuntimeError):
    """train.max_bad_steps consecutive steps had a non-finite loss, gradient or FP8 amax."""


class _BadStepCounter:
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
        return {"skipped_steps": self.total, "bad_streak": self.streak,
                "fp8_nonfinite_amax": self.nonfinite_amax}


def _drop_metrics_from(workdir: pathlib.Path, step: int) -> None:
    """A restarted run writes again the rows from `step` on (it repeats the steps after its
    checkpoint, or everything when it starts over): drop the old ones, and any row a kill cut
    short, so metrics.jsonl holds each step once, as an uninterrupted run writes it."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)


def _process_rows(sharding: NamedSharding, global_bs: int, seq_len: int) -> slice:
    """The rows of each global batch that this process's devices hold: the only rows it
    loads. Usually a contiguous block (build_mesh orders devices by process); all rows where
    processes replicate the batch (pipeline stages on different hosts)."""
    rows = set()
    for index in sharding.addressable_devices_indices_map((global_bs, seq_len)).values():
        rows.update(range(*index[0].indices(global_bs)))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ConfigError(f"this process's devices hold non-contiguous batch rows {sorted(rows)}; "
                          "use a mesh whose data/fsdp axes give each process one block of rows "
                          "(mesh.nvlink_domain = devices per process)")
    return slice(lo, hi)


def _build_data_in_turn(cfg: Config, workdir: pathlib.Path, rows: slice):
    """Process 0 first (it trains the tokenizer and writes the token caches in the shared
    workdir), then the others, which find them; no two processes write one file."""
    if jax.process_count() == 1:
        return build_data(cfg, workdir, rows=rows)
    from jax.experimental import multihost_utils

    data = build_data(cfg, workdir, rows=rows) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("titanax: data caches written")
    return data or build_data(cfg, workdir, rows=rows)


def _global_batch(batch: dict, sharding: NamedSharding, global_batch_size: int) -> dict:
    """Process-local rows -> one global array per key, sharded over the batch axis."""
    out = {}
    for k, v in batch.items():
        shape = (global_batch_size, *v.shape[1:])
        out[k] = jax.make_array_from_process_local_data(sharding, np.asarray(v), shape)
    return out


def _evaluate(eval_fn, params, val_batches, sharding, global_bs) -> float:
    total, count = 0.0, 0.0
    for b in val_batches:
        s, n = eval_fn(params, _global_batch(b, sharding, global_bs))
        total, count = total + float(s), count + float(n)
    return total / max(count, 1.0)


def _describe_processes() -> str:
    n = jax.process_count()
    if n == 1:
        return "1 process"
    return (f"{n} processes (jax.distributed), {jax.local_device_count()} local device(s) "
            "each; this log is process 0's")


@contextlib.contextmanager
def _compilation_cache(setting: str, workdir: pathlib.Path):
    """train.compilation_cache for the length of the run: XLA's compiled programs are written
    there and found again by a resumed run. Small compiles too (jax caches only those over 1 s
    by default; on a CPU even the train step may compile faster). The process's own settings
    come back afterwards: a library call leaves no cache switched on."""
    if not setting:
        yield None
        return
    # reset_cache: jax opens its cache once per process; moving it has no public API.
    from jax._src import compilation_cache

    path = os.path.abspath(os.path.expanduser(setting.replace("{workdir}", str(workdir))))
    names = {"jax_compilation_cache_dir": path,
             "jax_persistent_cache_min_compile_time_secs": 0.0,
             "jax_persistent_cache_min_entry_size_bytes": -1}
    before = {name: getattr(jax.config, name) for name in names}
    for name, value in names.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    try:
        yield path
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


class _Profile:
    """train.profile_steps START:END: a jax.profiler trace of the steps after START up to END,
    under WORKDIR/profile/process_<i> (one trace per process)."""

    def __init__(self, window, workdir: pathlib.Path, start_step: int, log):
        self.window, self.log, self.active = window, log, False
        self.folder = workdir / "profile" / f"process_{jax.process_index()}"
        if window and window[0] < start_step:
            log(f"train.profile_steps={window[0]}:{window[1]}: this run starts at step "
                f"{start_step}, past the window's start; no trace")
            self.window = None

    def before_step(self, done: int, last_metrics) -> None:
        """Called with `done` steps dispatched, before the next."""
        if self.window and done == self.window[0]:
            jax.block_until_ready(last_metrics)  # the steps before the window stay out of it
            jax.profiler.start_trace(str(self.folder))
            self.active = True

    def after_step(self, done: int, metrics) -> None:
        if self.active and done == self.window[1]:
            jax.block_until_ready(metrics)  # the trace must hold the last step's device work
            self.stop()

    def close(self) -> None:  # the run ended or stopped inside the window
        self.stop()

    def stop(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            self.log(f"profile of steps {self.window[0] + 1}-{self.window[1]} written to "
                     f"{self.folder}")


def _use_bar(cfg: Config, is_main: bool) -> bool:
    """A progress bar only where someone watches a terminal; a log file (sbatch, a pipe) gets
    one line per logged step instead of a bar's carriage returns."""
    return (is_main and cfg.train.progress_bar and sys.stdout.isatty()
            and sys.stderr.isatty())


def train(cfg: Config, workdir: str | pathlib.Path, *, log=print, devices=None) -> RunResult:
    """Runs (or resumes) training in workdir; devices defaults to all of jax.devices()."""
    workdir = pathlib.Path(workdir)
    with _compilation_cache(cfg.train.compilation_cache, workdir):
        return _train(cfg, workdir, log, devices)


def _train(cfg: Config, workdir: pathlib.Path, log, devices) -> RunResult:
    t_begin = time.perf_counter()
    is_main = jax.process_index() == 0
    if not is_main:  # one process speaks for the run; errors still raise everywhere
        log = lambda *_a, **_k: None  # noqa: E731
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    mesh = build_mesh(cfg.mesh, devices)
    batch_ways = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    if cfg.train.batch_size % batch_ways:
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be divisible by "
                          f"mesh data x fsdp = {batch_ways}")
    batch_sharding = NamedSharding(mesh, activation_spec(("batch", "seq")))
    data = _build_data_in_turn(cfg, workdir, _process_rows(batch_sharding,
                                                           cfg.train.batch_size,
                                                           cfg.train.seq_len))
    tx = make_optimizer(cfg)
    schedule = lr_schedule(cfg)
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)

    spec = model_spec(cfg.model)
    n_params = spec.count_params(cfg.model)
    n_no_embed = spec.count_params(cfg.model, exclude_embedding=True)
    fpt = M.flops_per_token(cfg.model, cfg.train.seq_len, n_no_embed)
    peak, peak_src = M.peak_flops_per_device(cfg.train.peak_flops, cfg.model.dtype)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    log(f"titanax: {n_params:,} parameters ({n_no_embed:,} without the input embedding)\n"
        f"  {M.FLOP_FORMULA} = {fpt:.4g} at S={cfg.train.seq_len}\n"
        f"  peak {peak / 1e9:.1f} GFLOP/s per device from {peak_src}\n"
        f"  {_describe_processes()}\n  {describe_mesh(mesh)}\n  data: {data.describe()}\n"
        f"{format_config(cfg)}")

    # State: resume from this workdir's newest intact checkpoint, else checkpoint.restore,
    # else init. The abstract state carries this run's mesh, so restoring reshards.
    train_iter = data.train_iterator()
    graphdef, abstract, shardings = abstract_train_state(cfg, mesh, tx)
    with model_context(mesh):
        restored = ckpt.restore_latest_good(abstract, model=cfg.model, log=log)
        source = ckpt
        if restored is None and cfg.checkpoint.restore:
            folder, only_step = resolve_restore_source(cfg.checkpoint.restore)
            source = Checkpointer(folder, cfg.checkpoint, read_only=True)
            restored = source.restore_latest_good(abstract, model=cfg.model, step=only_step,
                                                  log=log)
            source.close()
            if restored is None:
                raise ConfigError(f"checkpoint.restore={cfg.checkpoint.restore!r} holds no "
                                  f"checkpoint (looked in {folder})")
    run_state = {}
    if restored is not None:
        state = reorder_restored(restored.state, shardings, Config.from_dict(restored.config),
                                   cfg)
        start_step = int(state["step"])
        if source is ckpt:
            # Another run's data position means nothing here: only our own is restored.
            if restored.data_state is not None:
                train_iter.set_state(restored.data_state)
            run_state = restored.run_state
        log(f"resumed from {source.directory}/{restored.step} at step {start_step}")
    else:
        start_step = 0
        graphdef, state, shardings = create_train_state(cfg, mesh, tx)
    if is_main:  # step 0 is evaluated again by a run that starts there
        _drop_metrics_from(workdir, start_step + 1 if start_step else 0)

    step_fn = jit_train_step(cfg, mesh, graphdef, shardings, tx, schedule)
    eval_fn = jax.jit(make_eval_step(cfg, graphdef),
                      in_shardings=(shardings["params"], batch_sharding))
    val_batches = data.val_batches()
    writer = M.MetricsWriter(workdir, enabled=is_main,
                             purge_step=start_step + 1 if start_step else 0)
    bs = cfg.train.batch_size
    steps, log_every = cfg.train.steps, cfg.train.log_every

    bad_steps = _BadStepCounter(cfg.train.max_bad_steps, run_state)

    def save(step):
        bad_steps.flush()  # the counters saved must include this step
        ckpt.save(step, state, data_state=train_iter.get_state(), config=cfg.to_dict(),
                  run_state=bad_steps.state())

    losses, val_losses, rates = {}, {}, []
    preempted = False
    profile = _Profile(cfg.train.profile_window, workdir, start_step, log)
    # closing(ckpt): also on an error, wait for the save in flight; it is a good checkpoint.
    with (model_context(mesh), PreemptionWatch() as watch, contextlib.closing(ckpt),
          contextlib.closing(profile)):
        if start_step == 0:
            val = _evaluate(eval_fn, state["params"], val_batches, batch_sharding, bs)
            val_losses[0] = val
            writer.write(0, {"val_loss": val})
            log(f"step 0: val_loss {val:.4f}")
        bar = None
        if _use_bar(cfg, is_main):
            from tqdm import tqdm

            bar = tqdm(total=steps, initial=start_step, desc="train", unit="step",
                       dynamic_ncols=True)
        say = bar.write if bar is not None else log
        t_last, step_last = time.perf_counter(), start_step
        step, m = start_step, None
        while step < steps:
            profile.before_step(step, m)
            batch = _global_batch(next(train_iter), batch_sharding, bs)
            if step == start_step:  # compiled here, once, to report its memory before it runs
                t0 = time.perf_counter()
                compiled = step_fn.lower(state, batch).compile()
                now = time.perf_counter()
                log(f"train step compiled in {now - t0:.1f} s, {now - t_begin:.1f} s after the "
                    f"run started; {_describe_memory(compiled)}")
            state, m = step_fn(state, batch)  # returns at once: the devices run behind
            step += 1
            bad_steps.push(step, m)
            profile.after_step(step, m)
            log_now = step % log_every == 0 or step == steps
            eval_now = bool(cfg.train.eval_every) and step % cfg.train.eval_every == 0
            save_now = bool(cfg.checkpoint.every_steps) and step % cfg.checkpoint.every_steps == 0
            if log_now:
                m_host = bad_steps.flush()  # waits for this step
                now = time.perf_counter()
                tps = (step - step_last) * tokens_per_step / (now - t_last)
                # The first interval includes compilation: keep it out of the average.
                if step_last > start_step:
                    rates.append(tps)
                mfu = tps * fpt / (peak * jax.device_count()) if peak else 0.0
                in_use, peak_mem = M.device_memory()
                row = {"loss": float(m_host["loss"]), "grad_norm": float(m_host["grad_norm"]),
                       "lr": float(m_host["lr"]), "tokens_per_s": tps, "mfu": mfu,
                       "step_time": (now - t_last) / (step - step_last),
                       "skipped_steps": bad_steps.total, "mem_in_use": in_use,
                       "mem_peak": peak_mem, "elapsed_s": now - t_begin}
                t_last, step_last = now, step
                if cfg.model.matmul_precision == "fp8_delayed":  # run total, as skipped_steps
                    row["fp8_nonfinite_amax"] = bad_steps.nonfinite_amax
                losses[step] = row["loss"]
                writer.write(step, row)
                if bar is not None:
                    bar.update(step - bar.n)
                    bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tps:,.0f}",
                                    mfu=f"{mfu:.1%}")
                else:
                    log(M.step_line(step, steps, row))
            if eval_now or step == steps:
                val = _evaluate(eval_fn, state["params"], val_batches, batch_sharding, bs)
                val_losses[step] = val
                writer.write(step, {"val_loss": val})
                say(f"step {step}: val_loss {val:.4f}")
                t_last = time.perf_counter()  # evaluation time is not training throughput
            if save_now:
                save(step)
            # The stop flag is agreed (a collective across processes) only at steps where
            # every process waits for its devices anyway; they are the same on all of them.
            if (step < steps and (log_now or eval_now or save_now)
                    and watch.stop_requested()):
                preempted = True
                break
        if bar is not None:
            bar.update(step - bar.n)
            bar.close()
        bad_steps.flush()
        if ckpt.latest_step() != step:
            save(step)
    writer.close()
    if preempted:
        log(f"preempted ({watch.describe()}): saved a checkpoint at step {step} in "
            f"{ckpt.directory}; rerun the same command to resume")
        return RunResult(step, losses, val_losses, 0.0, workdir, bad_steps.total, True)
    if is_main:
        M.plot_loss(workdir)
    mean_rate = float(np.mean(rates)) if rates else 0.0
    log(f"done: step {step}, final loss {losses.get(step, float('nan')):.4f}, "
        f"val_loss {val_losses.get(step, float('nan')):.4f}, {mean_rate:,.0f} tokens/s; "
        f"checkpoints in {ckpt.directory}")
    return RunResult(step, losses, val_losses, mean_rate, workdir, bad_steps.total)


def _describe_memory(compiled) -> str:
    try:
        return M.describe_compiled_memory(compiled)
    except Exception as e:  # noqa: BLE001 - a backend without the analysis still trains
        return f"memory analysis unavailable ({type(e).__name__})"
