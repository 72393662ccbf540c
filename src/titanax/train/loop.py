"""The training loop: data -> step -> metrics -> checkpoints. No model logic lives here."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from titanax.checkpoint.orbax_io import Checkpointer
from titanax.config import Config, format_config
from titanax.data.pipeline import build_data
from titanax.models.llama import count_params
from titanax.parallel.mesh import build_mesh, describe_mesh
from titanax.parallel.rules import activation_spec, model_context
from titanax.train import metrics as M
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.state import abstract_train_state, create_train_state
from titanax.train.step import make_eval_step, make_train_step


@dataclasses.dataclass
class RunResult:
    final_step: int
    losses: dict[int, float]  # logged train losses by step
    val_losses: dict[int, float]
    tokens_per_s: float  # mean over the logged intervals after the first
    workdir: pathlib.Path


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


def train(cfg: Config, workdir: str | pathlib.Path, *, log=print, devices=None) -> RunResult:
    """Runs (or resumes) training in workdir; devices defaults to all of jax.devices()."""
    workdir = pathlib.Path(workdir)
    is_main = jax.process_index() == 0
    if is_main:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    mesh = build_mesh(cfg.mesh, devices)
    batch_ways = math.prod(mesh.shape[a] for a in ("data", "fsdp"))
    if cfg.train.batch_size % batch_ways:
        from titanax.config import ConfigError
        raise ConfigError(f"train.batch_size={cfg.train.batch_size} must be divisible by "
                          f"mesh data x fsdp = {batch_ways}")
    data = build_data(cfg, workdir, jax.process_index(), jax.process_count())
    tx = make_optimizer(cfg)
    schedule = lr_schedule(cfg)
    ckpt = Checkpointer(workdir / "checkpoints", cfg.checkpoint)

    n_params = count_params(cfg.model)
    n_no_embed = count_params(cfg.model, exclude_embedding=True)
    fpt = M.flops_per_token(cfg.model, cfg.train.seq_len, n_no_embed)
    peak, peak_src = M.peak_flops_per_device(cfg.train.peak_flops, cfg.model.dtype)
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    log(f"titanax: {n_params:,} parameters ({n_no_embed:,} without the input embedding)\n"
        f"  {M.FLOP_FORMULA} = {fpt:.4g} at S={cfg.train.seq_len}\n"
        f"  peak {peak / 1e9:.1f} GFLOP/s per device from {peak_src}\n"
        f"  {describe_mesh(mesh)}\n  data: {data.describe()}\n{format_config(cfg)}")

    # State: resume from this workdir's latest checkpoint, else checkpoint.restore, else init.
    train_iter = data.train_iterator()
    start_step = 0
    latest = ckpt.latest_step()
    restore_from = None
    if latest is not None:
        restore_from = (ckpt, latest)
    elif cfg.checkpoint.restore:
        other = Checkpointer(cfg.checkpoint.restore, dataclasses.replace(cfg.checkpoint, async_save=False))
        if other.latest_step() is None:
            from titanax.config import ConfigError
            raise ConfigError(f"checkpoint.restore={cfg.checkpoint.restore!r} holds no checkpoint")
        restore_from = (other, other.latest_step())
    if restore_from is not None:
        source, step = restore_from
        graphdef, abstract, shardings = abstract_train_state(cfg, mesh, tx)
        with model_context(mesh):
            state, data_state, _ = source.restore(step, abstract)
        if source is ckpt and data_state is not None:
            train_iter.set_state(data_state)
        start_step = int(state["step"])
        log(f"resumed from {source.directory}/{step} at step {start_step}")
    else:
        graphdef, state, shardings = create_train_state(cfg, mesh, tx)

    batch_sharding = NamedSharding(mesh, activation_spec(("batch", "seq")))
    step_fn = jax.jit(make_train_step(cfg, graphdef, tx, schedule),
                      in_shardings=(shardings, batch_sharding),
                      out_shardings=(shardings, None), donate_argnums=(0,))
    eval_fn = jax.jit(make_eval_step(cfg, graphdef),
                      in_shardings=(shardings["params"], batch_sharding))
    val_batches = data.val_batches()
    writer = M.MetricsWriter(workdir, enabled=is_main)
    bs = cfg.train.batch_size

    def save(step):
        ckpt.save(step, state, data_state=train_iter.get_state(), config=cfg.to_dict())

    losses, val_losses, rates = {}, {}, []
    with model_context(mesh):
        if start_step == 0:
            val = _evaluate(eval_fn, state["params"], val_batches, batch_sharding, bs)
            val_losses[0] = val
            writer.write(0, {"val_loss": val})
            log(f"step 0: val_loss {val:.4f}")
        bar = None
        if is_main and cfg.train.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train", unit="step",
                       dynamic_ncols=True)
        t_last, step_last = time.perf_counter(), start_step
        step = start_step
        while step < cfg.train.steps:
            batch = _global_batch(next(train_iter), batch_sharding, bs)
            state, m = step_fn(state, batch)
            step += 1
            if bar is not None:
                bar.update(1)
            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                m = jax.device_get(m)
                now = time.perf_counter()
                tps = (step - step_last) * tokens_per_step / (now - t_last)
                # The first interval includes compilation: keep it out of the average.
                if step_last > start_step:
                    rates.append(tps)
                t_last, step_last = now, step
                mfu = tps * fpt / (peak * jax.device_count()) if peak else 0.0
                row = {"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                       "lr": float(m["lr"]), "tokens_per_s": tps, "mfu": mfu}
                losses[step] = row["loss"]
                writer.write(step, row)
                if bar is not None:
                    bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{tps:,.0f}",
                                    mfu=f"{mfu:.1%}")
            eval_now = cfg.train.eval_every and step % cfg.train.eval_every == 0
            if eval_now or step == cfg.train.steps:
                val = _evaluate(eval_fn, state["params"], val_batches, batch_sharding, bs)
                val_losses[step] = val
                writer.write(step, {"val_loss": val})
                if bar is not None:
                    bar.write(f"step {step}: val_loss {val:.4f}")
                t_last = time.perf_counter()  # evaluation time is not training throughput
            if cfg.checkpoint.every_steps and step % cfg.checkpoint.every_steps == 0:
                save(step)
        if bar is not None:
            bar.close()
        if ckpt.latest_step() != step:
            save(step)
        ckpt.close()
    writer.close()
    if is_main:
        M.plot_loss(workdir)
    mean_rate = float(np.mean(rates)) if rates else 0.0
    log(f"done: step {step}, final loss {losses.get(step, float('nan')):.4f}, "
        f"val_loss {val_losses.get(step, float('nan')):.4f}, {mean_rate:,.0f} tokens/s; "
        f"checkpoints in {ckpt.directory}")
    return RunResult(step, losses, val_losses, mean_rate, workdir)
