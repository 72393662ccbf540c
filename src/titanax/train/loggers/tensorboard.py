"""TensorBoard events under WORKDIR/tb (tensorboardX, a titanax dependency; viewing them needs
`pip install 'titanax[tensorboard]'`, docs/monitoring.md)."""

from __future__ import annotations

import pathlib

from tensorboardX import SummaryWriter

from titanax.train.loggers import Resume, scalars


class TensorBoardLogger:
    FIX = "WORKDIR/tb must be a writable folder; or drop tensorboard from train.loggers"

    def start(self, workdir: pathlib.Path, config: dict, resume: Resume) -> None:
        # purge_step: TensorBoard hides the events an earlier run wrote from this step on, as
        # metrics.jsonl drops its rows, so a resumed run's repeated steps show once.
        self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tb"), purge_step=resume.purge_step)

    def log(self, step: int, values: dict) -> None:
        for k, v in scalars(values).items():  # TensorBoard stamps its own wall time
            self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()
