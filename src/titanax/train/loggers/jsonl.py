"""WORKDIR/metrics.jsonl: one JSON object per row. Always written (train.loggers must name it):
loss.png, `launch.plot_runs`, the rows a resume trims (metrics.drop_metrics_from) and the
tests read it."""

from __future__ import annotations

import json
import pathlib

from titanax.train.loggers import Resume


class JsonlLogger:
    def start(self, workdir: pathlib.Path, config: dict, resume: Resume) -> None:
        self.path = pathlib.Path(workdir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, values: dict) -> None:
        # Opened per row: a kill loses at most the row being written, which the next start's
        # drop_metrics_from removes.
        with self.path.open("a") as f:
            f.write(json.dumps({"step": int(step), **values}) + "\n")

    def close(self) -> None:
        pass
