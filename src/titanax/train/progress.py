"""Where logged steps show: a progress bar where someone watches a terminal; a log file
(sbatch, a pipe) gets one line per logged step instead of a bar's carriage returns."""

from __future__ import annotations

import sys

from titanax.config import Config
from titanax.train import metrics as M


class Progress:
    def __init__(self, cfg: Config, is_main: bool, start_step: int, log):
        self.log, self.steps, self.bar = log, cfg.train.steps, None
        if (is_main and cfg.train.progress_bar and sys.stdout.isatty()
                and sys.stderr.isatty()):
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="train",
                            unit="step", dynamic_ncols=True)

    def say(self, text: str) -> None:
        """A line of text; above the bar, which stays at the bottom, when there is one."""
        (self.bar.write if self.bar is not None else self.log)(text)

    def show(self, step: int, row: dict) -> None:
        """A logged step's metrics row."""
        if self.bar is None:
            self.log(M.step_line(step, self.steps, row))
            return
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}",
                             mfu=f"{row['mfu']:.1%}")

    def close(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.close()
