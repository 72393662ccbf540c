"""The run's metric loggers (train.loggers), fed by train/metrics.py's MetricsWriter on process
0. A logger is a class with three methods:

    start(workdir, config, resume)  # once, before the first row; config: Config.to_dict()
    log(step, values)               # each row: {name: number or None, ..., "time": Unix s}
    close()                         # once, at the end of the run (also after an error)

One file per logger in this folder, one entry in titanax/loggers.py LOGGERS. A logger that
keeps a run on a service (W&B, MLflow) stores its run id with `resume.remember` on its first
start and finds it with `resume.stored` when the workdir's run continues.

Optional, on the class: `check()` (a classmethod), run when the loggers are loaded, before
the run restores or writes anything: a setup that cannot work (W&B without an API key, an
MLflow server nothing listens at) raises ConfigError there, in seconds; and `FIX`, the fix
a failed start names. Every logger but jsonl runs guarded (Guarded below): any exception
from its start is one line naming the logger, the error and the fix, and its entry in
loggers.json is left as it was; one from `log` or `close` mid-run is one warning, never the
end of training (metrics.jsonl has every row)."""

from __future__ import annotations

import dataclasses
import errno
import importlib
import json
import os
import pathlib
import sys
import time
from typing import Protocol

from titanax.config.errors import ConfigError
from titanax.loggers import LOGGERS

STATE_FILE = "loggers.json"  # WORKDIR/loggers.json: {logger: {"run_id": ..., ...}}
UNGUARDED = ("jsonl",)  # metrics.jsonl is the run's record: its errors (a full disk) stop it
RETRY_AFTER_S = 60.0  # a service logger that failed mid-run is tried again after this long


@dataclasses.dataclass(frozen=True)
class Resume:
    """Where this run stands: purge_step, the first step it writes again (a resumed run repeats
    the steps after its checkpoint; None or 0: it starts at the beginning), and what the
    loggers stored in WORKDIR/loggers.json on an earlier start in this workdir."""

    purge_step: int | None
    path: pathlib.Path  # WORKDIR/loggers.json

    def stored(self, logger: str) -> dict:
        """What `logger` remembered on an earlier start here; {} for the first."""
        if not self.path.exists():
            return {}
        return json.loads(self.path.read_text()).get(logger, {})

    def remember(self, logger: str, **entry) -> None:
        """Stores `logger`'s entry (its run id, ...), whole or not at all: a kill mid-write
        leaves the previous file, so the next start still finds the run."""
        state = json.loads(self.path.read_text()) if self.path.exists() else {}
        state[logger] = entry
        tmp = self.path.with_name(f".{STATE_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, self.path)


class Logger(Protocol):
    def start(self, workdir: pathlib.Path, config: dict, resume: Resume) -> None: ...

    def log(self, step: int, values: dict) -> None: ...

    def close(self) -> None: ...


def load_loggers(names, *, check: bool = True) -> list[type]:
    """The classes of `names` (train.loggers' names, in order), imported and checked now: a
    logger whose package is missing, or whose `check()` refuses the setup, stops the run
    before it restores or compiles anything. Each but jsonl comes as its Guarded subclass."""
    classes = []
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"train.loggers: unknown logger {name!r}; known: {list(LOGGERS)}")
        module, _, cls_name = LOGGERS[name].partition(":")
        cls = getattr(importlib.import_module(module), cls_name)
        if check and callable(getattr(cls, "check", None)):
            cls.check()
        classes.append(cls if name in UNGUARDED else guarded(name, cls))
    return classes


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0].rstrip(".") if text else ""
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


class Guarded:
    """Mixed in before a logger's class (guarded()): its start fails in one line, its log and
    close never stop training. After a failed row it warns once, then drops the rows for
    RETRY_AFTER_S (a server that is down costs no time per step) and tries again; it says so
    when the service records again."""

    logger_name = "?"  # set by guarded(); FIX is read from the logger's own class

    def start(self, workdir: pathlib.Path, config: dict, resume: Resume) -> None:
        self._retry_at, self._failed_at = None, None
        before = resume.path.read_bytes() if resume.path.exists() else None
        try:
            super().start(workdir, config, resume)
        except Exception as e:
            # What this start stored (a W&B run id chosen before wandb.init) goes with it.
            if before is None:
                resume.path.unlink(missing_ok=True)
            elif resume.path.read_bytes() != before:
                resume.path.write_bytes(before)
            if isinstance(e, ConfigError):  # the logger's own line names the fix already
                raise
            fix = getattr(self, "FIX", "") or f"drop {self.logger_name} from train.loggers"
            raise ConfigError(f"train.loggers: {self.logger_name} could not start "
                              f"({_first_line(e)}); {fix}") from e

    def log(self, step: int, values: dict) -> None:
        if self._retry_at is not None and time.monotonic() < self._retry_at:
            return  # dropped: metrics.jsonl has the row
        try:
            super().log(step, values)
        except Exception as e:
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # a full disk is the run's (launch.train stops it in one line, exit 1)
            if self._failed_at is None:
                self._failed_at = step
                print(f"titanax: {self.logger_name} did not record step {step} "
                      f"({_first_line(e)}); training goes on, metrics.jsonl has every row; "
                      f"{self.logger_name} is tried again every {RETRY_AFTER_S:.0f} s",
                      file=sys.stderr, flush=True)
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            return
        if self._failed_at is not None:
            print(f"titanax: {self.logger_name} records again from step {step} (the rows "
                  f"from step {self._failed_at} until then are in metrics.jsonl only)",
                  file=sys.stderr, flush=True)
        self._retry_at, self._failed_at = None, None

    def close(self) -> None:
        try:
            super().close()
        except Exception as e:
            print(f"titanax: {self.logger_name} did not close its run ({_first_line(e)})",
                  file=sys.stderr, flush=True)


def guarded(name: str, cls: type) -> type:
    """cls with Guarded's start, log and close around its own."""
    return type(cls.__name__, (Guarded, cls), {"logger_name": name,
                                              "__module__": cls.__module__,
                                              "__qualname__": cls.__qualname__})


def missing_extra(package: str, extra: str) -> ConfigError:
    """The one-line error for a logger whose optional package is not installed."""
    return ConfigError(f"train.loggers: {extra!r} needs the {package} package: "
                       f"pip install 'titanax[{extra}]' (or drop {extra} from train.loggers)")


def scalars(values: dict) -> dict[str, float]:
    """The row's numbers as the services plot them: without `time` (each stamps its own) and
    without what is not a number (mem_in_use is None on XLA:CPU)."""
    return {k: v for k, v in values.items()
            if k != "time" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(config: dict, prefix: str = "") -> dict[str, object]:
    """{'train': {'steps': 10}} -> {'train.steps': 10}: the --set names, for services that
    keep flat key/value parameters (MLflow)."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
