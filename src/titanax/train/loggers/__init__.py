"""The run's metric loggers (train.loggers), fed by train/metrics.py's MetricsWriter on process
0. A logger is a class with three methods:

    start(workdir, config, resume)  # once, before the first row; config: Config.to_dict()
    log(step, values)               # each row: {name: number or None, ..., "time": Unix s}
    close()                         # once, at the end of the run (also after an error)

One file per logger in this folder, one entry in titanax/loggers.py LOGGERS. A logger that
keeps a run on a service (W&B, MLflow) stores its run id with `resume.remember` on its first
start and finds it with `resume.stored` when the workdir's run continues."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pathlib
from typing import Protocol

from titanax.config.errors import ConfigError
from titanax.loggers import LOGGERS

STATE_FILE = "loggers.json"  # WORKDIR/loggers.json: {logger: {"run_id": ..., ...}}


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


def load_loggers(names) -> list[type]:
    """The classes of `names` (train.loggers' names, in order), imported now: a logger whose
    package is missing stops the run before it restores or compiles anything."""
    classes = []
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"train.loggers: unknown logger {name!r}; known: {list(LOGGERS)}")
        module, _, cls = LOGGERS[name].partition(":")
        classes.append(getattr(importlib.import_module(module), cls))
    return classes


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
