"""train.profile_steps START:END: a jax.profiler trace of the steps after START up to END."""

from __future__ import annotations

import pathlib

import jax


class ProfileWindow:
    """Traces the window's steps under WORKDIR/profile/process_<i> (one trace per process)."""

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
