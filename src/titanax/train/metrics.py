"""The run's metric records: written on process 0 to the configured loggers (metrics.jsonl,
TensorBoard, W&B, MLflow: titanax/train/loggers/), read back from metrics.jsonl, trimmed when a
restarted run writes steps again, and plotted."""

from __future__ import annotations

import json
import pathlib
import time

import jax
import numpy as np

from titanax.config import TrainConfig
from titanax.loggers import DEFAULT_LOGGERS
from titanax.train.loggers import STATE_FILE, Resume, load_loggers


class MetricsWriter:
    """Each row to the run's loggers (train.loggers, titanax/train/loggers/): metrics.jsonl,
    TensorBoard events under WORKDIR/tb, W&B, MLflow; writes only on process 0. Every row
    gets `time` (Unix seconds). purge_step: the first step this run writes again (a resumed
    run repeats the steps after its checkpoint); TensorBoard hides the older events from there
    on, as metrics.jsonl drops its rows. config: Config.to_dict(), which W&B and MLflow record
    with the run."""

    def __init__(self, workdir: pathlib.Path, *, enabled: bool = True,
                 purge_step: int | None = None, loggers=DEFAULT_LOGGERS,
                 config: dict | None = None):
        self.enabled = enabled
        workdir = pathlib.Path(workdir)
        self.path = workdir / "metrics.jsonl"
        self.loggers = []
        if not enabled:
            return
        # The config's own parsing and checks (a comma-separated string or a sequence).
        names = TrainConfig(loggers=loggers).logger_names
        resume = Resume(purge_step, workdir / STATE_FILE)
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            for cls in load_loggers(names):
                logger = cls()
                logger.start(workdir, config or {}, resume)
                self.loggers.append(logger)
        except BaseException:  # a later logger failed: the runs opened so far end now
            self.close()
            raise

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        values = {**{k: _plain(v) for k, v in values.items()}, "time": round(time.time(), 3)}
        for logger in self.loggers:
            logger.log(int(step), values)

    def close(self) -> None:
        """Closes every logger, even after one fails (the first error is raised); closing again
        does nothing."""
        loggers, self.loggers = self.loggers, []
        error = None
        for logger in loggers:
            try:
                logger.close()
            except Exception as e:  # the others still end their runs
                error = error or e
        if error is not None:
            raise error


def _plain(v):
    if isinstance(v, (np.generic, jax.Array)):
        return np.asarray(v).item()
    return v


def read_metrics(workdir) -> list[dict]:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def drop_metrics_from(workdir: pathlib.Path, step: int) -> None:
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


def plot_loss(workdir) -> pathlib.Path | None:
    """WORKDIR/loss.png: training and validation loss against step."""
    rows = read_metrics(workdir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss")
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = pathlib.Path(workdir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_runs(runs: dict[str, str | pathlib.Path], out: str | pathlib.Path) -> pathlib.Path:
    """Several runs' curves side by side: training loss (left) and validation loss (right)
    against step, one line per {label: workdir}; for comparisons such as docs/fp8_loss.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(11, 4))
    for label, workdir in runs.items():
        rows = read_metrics(workdir)
        if not rows:
            raise FileNotFoundError(f"{workdir}: no metrics.jsonl rows; is it a run folder?")
        ax_train.plot(*zip(*[(r["step"], r["loss"]) for r in rows if "loss" in r]), label=label)
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if val:
            ax_val.plot(*zip(*val), "o-", label=label)
    for ax, title in ((ax_train, "training loss"), (ax_val, "validation loss")):
        ax.set(title=title, xlabel="step", ylabel="cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
    out = pathlib.Path(out)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
