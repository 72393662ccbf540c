"""The training loop: data -> step -> metrics -> checkpoints. No model logic lives here.

Fault tolerance: a run resumes from its workdir's newest intact checkpoint (a damaged one is
reported and skipped), SIGTERM/SIGUSR1 save at the next step boundary and return normally,
and steps with a non-finite loss or gradient are skipped and counted. The train state holds no
RNG: the step is a pure function of (state, batch) (LoRA adapter dropout draws its masks from
train.seed and the step count, models/common/lora.py), and the data order is fixed by
train.seed plus the grain iterator position saved with every checkpoint.
A resumed run therefore logs the same losses, step for step, as one never interrupted.

The host runs ahead of the devices: it reads nothing back (metrics, the skipped-step flags, the
stop flag) except at logging, evaluation and checkpoint steps, where it waits for them anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import time

import jax
from jax.sharding import NamedSharding

from titanax.checkpoint.lora_base import FrozenBase
from titanax.checkpoint.manager import Checkpointer, resolve_restore_source
from titanax.config import SOURCE_UNSET, Config, ConfigError, format_config
from titanax.data.pipeline import build_data, check_source_kind, with_epoch_steps
from titanax.ops.linear import precision_refusal
from titanax.parallel.layer_order import reorder_restored
from titanax.parallel.mesh import build_mesh, check_layout, describe_mesh
from titanax.parallel.rules import batch_input_spec, model_context
from titanax.preemption import PreemptionWatch, first_step_dispatched
from titanax.train import metrics as M
from titanax.train.attention_check import first_contact
from titanax.train.bad_steps import BadStepCounter, TrainingDiverged
from titanax.train.batches import global_batch, process_rows
from titanax.train.compilation_cache import compilation_cache
from titanax.train.optim import horizon_change, lr_schedule, make_optimizer
from titanax.train.profile_window import ProfileWindow
from titanax.train.resolved import resolve
from titanax.train.resume_check import ResumeCheck
from titanax.train.run_log import (
    Progress,
    describe_accumulation,
    describe_memory,
    describe_processes,
    device_memory,
)
from titanax.train.state import (
    init_train_state,
    jit_eval_step,
    jit_train_step,
    needs_fresh_adapters,
    restored_state,
    state_layout,
    trainable_count,
    with_fresh_adapters,
)
from titanax.train.throughput import FLOP_FORMULA, Throughput, peak_flops_per_device
from titanax.train.workdir_lock import WorkdirLocked, workdir_lock

__all__ = ["RunResult", "Trainer", "TrainingDiverged", "WorkdirLocked", "train"]


@dataclasses.dataclass
class RunResult:
    final_step: int
    losses: dict[int, float]  # logged train losses by step
    val_losses: dict[int, float]
    tokens_per_s: float  # mean over the logged intervals after the first
    workdir: pathlib.Path
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient, whole run
    preempted: bool = False  # stopped early by SIGTERM/SIGUSR1/Ctrl-C after saving a checkpoint
    exit_code: int = 0  # launch.train's: 75 after SIGTERM/SIGUSR1 (requeue), 130 after Ctrl-C


def train(cfg: Config, workdir: str | pathlib.Path, *, log=print, devices=None,
          fit=None) -> RunResult:
    """Runs (or resumes) training in workdir; devices defaults to all of jax.devices().
    fit(cfg, mesh, log) -> (cfg, compiled step or None): checks the step's memory before
    anything is built and resolves train.grad_accum=auto (launch.train passes
    titanax.plan.fit.fit_to_devices)."""
    workdir = pathlib.Path(workdir)
    if cfg.data.source == SOURCE_UNSET:  # an import: never the embedded corpus by default
        raise ConfigError(
            f"data.source is not set (the run in {workdir} was imported without training "
            "data): give --set data.source=DIR, a folder written by python -m "
            "launch.prepare_data (or a mixture, DIR1:0.7,DIR2:0.3)")
    check_source_kind(cfg)  # a text folder for a fine-tuning run: refused before anything
    # One run per workdir, for the run's whole life (process 0 holds it for all of them).
    with (workdir_lock(workdir, enabled=jax.process_index() == 0),
          compilation_cache(cfg.train.compilation_cache, workdir) as cache_dir):
        return Trainer(cfg, workdir, log, devices, fit, cache_dir=cache_dir).run()


def _build_data_in_turn(cfg: Config, workdir: pathlib.Path, rows: slice):
    """Process 0 first (it trains the tokenizer and writes the token caches in the shared
    workdir), then the others, which find them; no two processes write one file."""
    if jax.process_count() == 1:
        return build_data(cfg, workdir, rows=rows)
    from jax.experimental import multihost_utils

    data = build_data(cfg, workdir, rows=rows) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("titanax: data caches written")
    return data or build_data(cfg, workdir, rows=rows)


def write_config_json(workdir: pathlib.Path, cfg: Config) -> None:
    """WORKDIR/config.json, the config the run trains with, written whole or not at all (a
    kill mid-write leaves the previous one): `launch.train --workdir W` continues from it."""
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = workdir / f".config.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(cfg.to_dict(), indent=2))
    os.replace(tmp, workdir / "config.json")


class Trainer:
    """One run in one workdir. Building it restores (or initialises) the state and compiles
    nothing yet; run() trains to train.steps, or to a preemption, and returns a RunResult.
    cache_dir: the compilation cache folder train() set up (None: none), where the attention
    check keeps its verdicts."""

    def __init__(self, cfg: Config, workdir: pathlib.Path, log=print, devices=None,
                 fit=None, *, cache_dir: str | None = None):
        self.t_begin = time.perf_counter()
        self.workdir = workdir
        self.is_main = jax.process_index() == 0
        # One process speaks for the run; errors still raise everywhere.
        self.log = log if self.is_main else (lambda *_a, **_k: None)
        # A logger's missing package, or a setup that cannot work (W&B without an API key, an
        # MLflow server nothing listens at: its check()), stops the run before any restore.
        if self.is_main:
            M.load_loggers(cfg.train.logger_names)
        self.mesh = build_mesh(cfg.mesh, devices)
        check_layout(cfg, self.mesh)  # and the batch rule, all before orbax opens anything
        if why := precision_refusal(cfg.execution.matmul_precision):  # e.g. mxfp8 on Hopper
            raise ConfigError(why)
        # A kernel `auto` would run that no GPU run has checked here is checked now, before
        # anything compiles the step (the memory check does): a failing one is refused.
        first_contact(cfg, self.mesh, cache_dir, self.log)
        # Before any state or data exists: a step that cannot fit stops here, in seconds.
        # The step compiled for the check is the one the first step runs (jax reuses it).
        self.checked_step = None  # the step the check compiled, run as is (no second compile)
        if fit is not None:
            cfg, self.checked_step = fit(cfg, self.mesh, self.log)
        elif cfg.train.grad_accum_auto:
            raise ConfigError("train.grad_accum=auto is chosen by a memory check: run "
                              "launch.train, or pass fit=titanax.plan.fit.fit_to_devices")
        if cfg.train.epochs:  # passes over the data: the step count the schedule spans
            cfg, line = with_epoch_steps(cfg, workdir)
            self.log(line)
        self.cfg = cfg
        self.spec = resolve(cfg).spec  # once: the state, step, optimizer and log take it
        self.batch_sharding = NamedSharding(self.mesh, batch_input_spec())
        self.tx, self.schedule = make_optimizer(cfg, no_decay=self.spec.no_decay), lr_schedule(cfg)
        self.ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)
        # The model is checked against the checkpoint it resumes before anything in the
        # workdir changes: a refused run leaves config.json, the tokenizer and the metrics as
        # they were (an imported run stays the imported run).
        run_state, data_state, resumed = self.restore_or_init()
        self._refuse_steps_behind(resumed)
        # The rows the run logged after its checkpoint, read before they are dropped below:
        # the first step logged again is compared with them (train/resume_check.py).
        self.resume_check = ResumeCheck(workdir, self.start_step, saved=self.saved_config,
                                        now=cfg.to_dict(), own_run=data_state is not None,
                                        schedule_change=self.schedule_change)
        # The data next (a missing folder, another tokenizer, a vocabulary too small); only
        # the embedded corpus writes here, its tokenizer and token caches, once they are valid.
        self.data = _build_data_in_turn(cfg, workdir, process_rows(
            self.batch_sharding, cfg.train.batch_size, cfg.train.seq_len))
        # The last checks that can refuse the command come before the workdir changes: the
        # validation batches (a split that cannot fill one) and the loggers' start (an MLflow
        # store that cannot be written, W&B without a key). A refused command leaves
        # config.json and metrics.jsonl as they were: the run stays the run it was.
        self.val_batches = self.data.val_batches()
        self.writer = M.MetricsWriter(workdir, enabled=self.is_main,
                                      purge_step=self.start_step + 1 if self.start_step else 0,
                                      loggers=cfg.train.logger_names, config=cfg.to_dict())
        try:
            if self.is_main:  # the config as it runs (grad_accum=auto as chosen)
                write_config_json(workdir, cfg)
            self._announce()
            if resumed:
                self.log(resumed)
                if self.schedule_change:
                    self.log(self.schedule_change)
            self.train_iter = self.data.train_iterator()
            if data_state is not None:
                self.train_iter.set_state(data_state)
            if self.is_main:  # step 0 is evaluated again by a run that starts there
                M.drop_metrics_from(workdir, self.start_step + 1 if self.start_step else 0)
            self.step_fn = jit_train_step(cfg, self.mesh, self.graphdef, self.shardings, self.tx,
                                          self.schedule, spec=self.spec, roles=self.roles)
            self.eval_fn = jit_eval_step(cfg, self.mesh, self.graphdef, self.shardings)
        except BaseException:  # the loggers' runs (W&B, MLflow) end with the command
            self.writer.close()
            raise
        self.bad_steps = BadStepCounter(cfg.train.max_bad_steps, run_state)
        self.profile = ProfileWindow(cfg.train.profile_window, workdir, self.start_step, self.log)
        self.losses, self.val_losses = {}, {}
        self.throughput = Throughput(self.start_step,
                                     cfg.train.batch_size * cfg.train.seq_len)

    def _refuse_steps_behind(self, resumed: str) -> None:
        """A train.steps below the checkpoint's step has nothing to train: refused, rather
        than ending in "done: ... final loss nan"."""
        if self.start_step > self.cfg.train.steps:
            self.ckpt.close()
            raise ConfigError(
                f"train.steps={self.cfg.train.steps}: the checkpoint is at step "
                f"{self.start_step}, past it ({resumed}); to train further set train.steps "
                f"above {self.start_step}")

    def _announce(self) -> None:
        """Logs what the run trains on what, and the FLOP count its MFU is measured by."""
        cfg, seq_len = self.cfg, self.cfg.train.seq_len
        spec = self.spec
        n_params = spec.count_params(cfg.model)
        n_no_embed = spec.count_params(cfg.model, exclude_embedding=True)
        self.flops_per_token = spec.flops(cfg.model, seq_len, n_no_embed)
        self.peak, peak_src = peak_flops_per_device(cfg.train.peak_flops, cfg.execution.dtype)
        trainable = trainable_count(self.state, self.roles)
        self.log(f"titanax: {n_params:,} parameters ({n_no_embed:,} without the input "
                 f"embedding), {trainable:,} trainable\n"
                 f"  {FLOP_FORMULA} = {self.flops_per_token:.4g} at S={seq_len}\n"
                 f"  peak {self.peak / 1e9:.1f} GFLOP/s per device from {peak_src}\n"
                 f"  {describe_processes()}\n  {describe_mesh(self.mesh)}\n"
                 f"  {self.data.describe()}\n{format_config(cfg)}")
        accumulation = describe_accumulation(cfg, dict(self.mesh.shape).get("pipeline", 1))
        if accumulation:
            self.log(f"  {accumulation}")

    # --- state --------------------------------------------------------------------------------

    def restore_or_init(self) -> tuple[dict, dict | None, str]:
        """Sets graphdef, state, shardings and start_step: resumed from this workdir's newest
        intact checkpoint, else from checkpoint.restore, else initialised. The abstract state
        carries this run's mesh, so restoring reshards. Returns (the run state to continue
        (bad-step counts), the data iterator's position, the line saying where it resumed);
        the first two are empty unless resuming this workdir's own run."""
        cfg = self.cfg
        self.schedule_change = ""  # the log line for a resume onto another lr curve
        self.saved_config = None  # the resumed checkpoint's config (dict)
        layout = state_layout(cfg, self.mesh, self.tx, spec=self.spec)  # one eval_shape
        self.graphdef, self.shardings, self.roles = layout.graphdef, layout.shardings, layout.roles
        # The checkpoint manager reads and writes the state's on-disk layout (a dict).
        restored, source = self._find_checkpoint(layout.abstract.to_saved())
        # Where the run's frozen weights (a LoRA run's base) are stored: its saves name them.
        self.frozen_base = FrozenBase(kept=self.roles.keeps_frozen_base)
        if restored is None:
            self.start_step = 0
            self.state = init_train_state(cfg, self.mesh, self.tx, layout)
            return {}, None, ""
        self.frozen_base.restored(restored.lora_base)
        self.saved_config = restored.config
        saved = Config.from_dict(restored.config)
        self.state = restored_state(restored.state, self.roles, self.shardings,
                                    lambda st, sh: reorder_restored(st, sh, saved, cfg))
        adapters = ""
        if needs_fresh_adapters(layout.abstract, self.state):  # LoRA starting from a base
            self.state = with_fresh_adapters(cfg, self.mesh, self.tx, self.state, layout)
            adapters = f" (its weights as the frozen base of new rank-{cfg.lora.rank} LoRA adapters)"
        self.start_step = int(self.state.step)
        # The step count carries on: a new horizon or schedule bends the lr curve from here
        # (at step 0 the whole curve is new, nothing to say).
        if self.start_step:
            self.schedule_change = horizon_change(saved, cfg, self.start_step)
        run_state, data_state = {}, None
        if source is self.ckpt:
            # Another run's data position means nothing here: only our own is restored.
            data_state, run_state = restored.data_state, restored.run_state
        return (run_state, data_state,
                f"resumed from {source.directory}/{restored.step} at step {self.start_step}"
                f"{adapters}")

    def _find_checkpoint(self, abstract):
        """(restored or None, the Checkpointer it came from)."""
        cfg = self.cfg
        with model_context(self.mesh):
            restored = self.ckpt.restore_latest_good(abstract, cfg=cfg, log=self.log)
            if restored is not None or not cfg.checkpoint.restore:
                return restored, self.ckpt
            folder, only_step = resolve_restore_source(cfg.checkpoint.restore)
            source = Checkpointer(folder, cfg.checkpoint, read_only=True)
            restored = source.restore_latest_good(abstract, cfg=cfg, step=only_step,
                                                  log=self.log)
            source.close()
            if restored is None:
                raise ConfigError(f"checkpoint.restore={cfg.checkpoint.restore!r} holds no "
                                  f"checkpoint (looked in {folder})")
            return restored, source

    # --- the loop -----------------------------------------------------------------------------

    def run(self) -> RunResult:
        steps, start = self.cfg.train.steps, self.start_step
        step, metrics, preempted = start, None, False
        # closing(ckpt): also on an error, wait for the save in flight; it is a good checkpoint.
        # closing(writer): also on an error, the W&B and MLflow runs are ended and flushed.
        with (contextlib.closing(self.writer), model_context(self.mesh),
              PreemptionWatch() as watch, contextlib.closing(self.ckpt),
              contextlib.closing(self.profile)):
            if start == 0:
                self.evaluate(0, self.log)
            progress = Progress(self.cfg, self.is_main, start, self.log)
            self.throughput.restart_clock()  # the first interval, with the compile, starts here
            while step < steps:
                step, metrics = self.step(step, metrics)
                log_now, eval_now, save_now = self._due(step)
                if log_now:
                    self.log_metrics(step, progress)
                if eval_now or step == steps:
                    self.evaluate(step, progress.say)
                if save_now:
                    self.save(step)
                # The stop flag is agreed (a collective across processes) only at steps where
                # every process waits for its devices anyway; they are the same on all of them.
                if (step < steps and (log_now or eval_now or save_now)
                        and watch.stop_requested()):
                    preempted = True
                    break
            progress.close(step)
            self.bad_steps.flush()
            if self.ckpt.latest_step() != step:
                self.save(step)
        return self._result(step, preempted, watch)

    def _due(self, step: int) -> tuple[bool, bool, bool]:
        """(log, evaluate, save) at this step."""
        t, every_save = self.cfg.train, self.cfg.checkpoint.every_steps
        return (step % t.log_every == 0 or step == t.steps,
                bool(t.eval_every) and step % t.eval_every == 0,
                bool(every_save) and step % every_save == 0)

    def step(self, done: int, last_metrics):
        """Dispatches step done + 1; returns (done + 1, its metrics, still on the devices)."""
        self.profile.before_step(done, last_metrics)
        batch = global_batch(next(self.train_iter), self.batch_sharding,
                             self.cfg.train.batch_size)
        if done == self.start_step:  # compiled here, once, to report its memory before it runs
            self._compile(batch)
        self.state, metrics = self.step_fn(self.state, batch)  # returns at once
        if done == self.start_step:  # compiled and running: a signal now saves the work
            first_step_dispatched()
        done += 1
        self.bad_steps.push(done, metrics)
        self.profile.after_step(done, metrics)
        return done, metrics

    def _compile(self, batch) -> None:
        t0 = time.perf_counter()
        if self.checked_step is not None:  # compiled for the same state and batch shardings
            compiled = self.step_fn = self.checked_step
        else:
            compiled = self.step_fn.lower(self.state, batch).compile()
        now = time.perf_counter()
        when = ("by the memory check" if self.checked_step is not None else
                f"in {now - t0:.1f} s, {now - self.t_begin:.1f} s after the run started")
        self.log(f"train step compiled {when}; {describe_memory(compiled)}")

    def log_metrics(self, step: int, progress: Progress) -> None:
        """Waits for this step, then writes its metrics.jsonl row and shows it."""
        m_host = self.bad_steps.flush()
        tps, step_time, now = self.throughput.interval(step)
        mfu = (tps * self.flops_per_token / (self.peak * jax.device_count())
               if self.peak else 0.0)
        in_use, peak_mem = device_memory()
        row = {"loss": float(m_host["loss"]), "grad_norm": float(m_host["grad_norm"]),
               "lr": float(m_host["lr"]), "tokens_per_s": tps, "mfu": mfu,
               "step_time": step_time, "skipped_steps": self.bad_steps.total,
               "mem_in_use": in_use, "mem_peak": peak_mem, "elapsed_s": now - self.t_begin}
        if self.cfg.execution.matmul_precision == "fp8_delayed":  # run total, as skipped_steps
            row["fp8_nonfinite_amax"] = self.bad_steps.nonfinite_amax
        # the architecture's auxiliary losses and routing statistics (an MoE's), this step's
        row.update({k: float(v) for k, v in m_host.items() if k.startswith("aux/")})
        self.resume_check.check(step, row["loss"], self.ckpt, self.log)  # the first after a resume
        self.losses[step] = row["loss"]
        self.writer.write(step, row)
        progress.show(step, row)

    def evaluate(self, step: int, say) -> None:
        if not self.val_batches:  # no validation split (data.val_fraction=0)
            return
        total, count = 0.0, 0.0
        for b in self.val_batches:
            s, n = self.eval_fn(self.state,
                                global_batch(b, self.batch_sharding, self.cfg.train.batch_size))
            total, count = total + float(s), count + float(n)
        val = total / max(count, 1.0)
        self.val_losses[step] = val
        self.writer.write(step, {"val_loss": val})
        say(f"step {step}: val_loss {val:.4f}")
        self.throughput.restart_clock()  # evaluation time is not training throughput

    def save(self, step: int) -> None:
        self.bad_steps.flush()  # the counters saved must include this step
        self.ckpt.save(step, self.state.to_saved(), data_state=self.train_iter.get_state(),
                       config=self.cfg.to_dict(), run_state=self.bad_steps.state(),
                       lora_base=self.frozen_base.ref)
        self.frozen_base.saved(self.ckpt.directory, step)

    def _result(self, step: int, preempted: bool, watch: PreemptionWatch) -> RunResult:
        skipped = self.bad_steps.total
        if preempted:
            self.log(f"preempted ({watch.describe()}): saved a checkpoint at step {step} in "
                     f"{self.ckpt.directory}; rerun the same command to resume")
            return RunResult(step, self.losses, self.val_losses, 0.0, self.workdir, skipped,
                             True, watch.exit_code)
        if step == self.start_step and step:  # a finished run run again: no "loss nan"
            self.log(f"done: nothing to train, the checkpoint is at step {step} = train.steps; "
                     f"to train further set train.steps above {step}")
            return RunResult(step, self.losses, self.val_losses, 0.0, self.workdir, skipped)
        if self.is_main:
            M.plot_loss(self.workdir)
        mean_rate = self.throughput.mean()
        val = (f"val_loss {self.val_losses.get(step, float('nan')):.4f}, "
               if self.val_batches else "")
        self.log(f"done: step {step}, final loss {self.losses.get(step, float('nan')):.4f}, "
                 f"{val}"
                 f"{mean_rate:,.0f} tokens/s; checkpoints in {self.ckpt.directory}")
        return RunResult(step, self.losses, self.val_losses, mean_rate, self.workdir, skipped)
