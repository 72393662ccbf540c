"""Weights & Biases (`pip install 'titanax[wandb]'`): one W&B run per workdir. Its id is stored
in WORKDIR/loggers.json on the first start; a resumed run continues it (resume="allow"). The
project is $WANDB_PROJECT (default "titanax"); $WANDB_ENTITY, $WANDB_MODE (offline) and the rest
of W&B's variables apply as W&B reads them. The run's files go under $WANDB_DIR if set, else
WORKDIR/wandb."""

from __future__ import annotations

import os
import pathlib
import secrets

from titanax.config.errors import ConfigError
from titanax.train.loggers import Resume, missing_extra, scalars

try:
    import wandb
except ModuleNotFoundError:
    raise missing_extra("wandb", "wandb") from None


NO_SERVER_MODES = ("offline", "disabled", "dryrun")
_FIX = ("run `wandb login` or set WANDB_API_KEY (WANDB_MODE=offline logs without a server), "
        "or drop wandb from train.loggers; docs/monitoring.md")


def _has_credentials() -> bool:
    """An API key W&B will find: $WANDB_API_KEY, an identity token file, or ~/.netrc's entry
    for the server (what `wandb login` writes). True when that cannot be told."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

        return bool(read_netrc_auth(host=os.environ.get("WANDB_BASE_URL")
                                    or "https://api.wandb.ai"))
    except Exception:  # noqa: BLE001 - another wandb version: wandb.init tells
        return True


class WandbLogger:
    FIX = _FIX

    @classmethod
    def check(cls) -> None:
        """Online W&B without an API key: refused before the run restores or writes anything
        (wandb.init would stop on it later, or wait at a login prompt)."""
        mode = (os.environ.get("WANDB_MODE") or "online").strip().lower()
        if mode in NO_SERVER_MODES or _has_credentials():
            return
        raise ConfigError(f"train.loggers: wandb has no API key (WANDB_MODE={mode}): {_FIX}")

    def start(self, workdir: pathlib.Path, config: dict, resume: Resume) -> None:
        workdir = pathlib.Path(workdir)
        run_id = resume.stored("wandb").get("run_id")
        if run_id is None:
            # Chosen and stored before wandb.init: a run killed during its first start
            # continues the same W&B run when the workdir is run again.
            run_id = secrets.token_hex(6)
            resume.remember("wandb", run_id=run_id)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "titanax", id=run_id, resume="allow",
            name=workdir.name, config=config,
            dir=None if os.environ.get("WANDB_DIR") else str(workdir))
        # W&B keeps a run's steps increasing and drops a step below its newest. A resumed run
        # repeats the steps after its checkpoint; W&B keeps the first values of those (a
        # resume logs bitwise the same losses), and they are skipped here rather than warned
        # about one by one.
        self._first_new_step = self._run.starting_step

    def log(self, step: int, values: dict) -> None:
        if step >= self._first_new_step:
            self._run.log(scalars(values), step=step)

    def close(self) -> None:
        self._run.finish()
        # The training process owns W&B: stop its service process (wandb-core) now rather
        # than at interpreter exit, so nothing outlives the run (a test, a notebook).
        wandb.teardown()
