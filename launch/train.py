"""python -m launch.train [--config FILE.py|FILE.gin] [--set section.field=value ...]
                          [--workdir DIR] [--host-devices N] [--help-config]
                          [--coordinator HOST:PORT --num-processes N --process-id I]

Without --config: the config saved in WORKDIR/config.json when there is one (an import or an
earlier run), else configs/tiny.py; --set applies on top either way.

Exit status: 0 when train.steps are done, 75 (EX_TEMPFAIL) when stopped by SIGTERM/SIGUSR1
after saving a checkpoint, or during start-up before the first step (nothing to save), or when
another live run holds the workdir's lock (rerun the same command, or requeue the job, to
resume), 130 when stopped by Ctrl-C (saved the same way; a second Ctrl-C stops without
saving), 1 when
training diverged or a process was lost, 2 for a configuration error (a train step that
does not fit the devices' memory is one: the error names the --set that fits)."""

from __future__ import annotations

import argparse
import pathlib

from launch.common import (
    add_config_flags,
    add_distributed_flags,
    add_host_devices_flag,
    fail,
    setup_jax,
    stop,
)

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: a checkpoint is saved, run again to resume
DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "tiny.py"


def _base_config(args):
    """--config with --set; without --config, the workdir's own config.json (written by
    launch.import_hf or an earlier run: `launch.train --workdir W` continues W as it was
    configured) or configs/tiny.py for a new run."""
    from titanax.config import ConfigError, load_config

    saved = pathlib.Path(args.workdir) / "config.json" if args.workdir else None
    if args.config is not None or saved is None or not saved.is_file():
        return load_config(args.config or DEFAULT_CONFIG, args.overrides)
    try:
        return load_config(saved, args.overrides)
    except ConfigError as e:
        raise ConfigError(f"{e}; give --config FILE") from None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__)
    add_config_flags(p, default_config=None)
    add_host_devices_flag(p)
    add_distributed_flags(p)
    p.add_argument("--workdir", default=None, help="run folder (default runs/<config name>)")
    p.add_argument("--help-config", action="store_true",
                   help="list every config field (section.field = default, one line each) "
                   "and exit")
    args = p.parse_args(argv)
    if args.help_config:
        from titanax.config.describe import describe_config

        print(describe_config())
        return

    from titanax.config import ConfigError

    try:
        cfg = _base_config(args)
    except ConfigError as e:
        fail(str(e))
    workdir = args.workdir or f"runs/{pathlib.Path(args.config or DEFAULT_CONFIG).stem}"
    from titanax import xla_flags

    xla_flags.apply_for_run(args.host_devices)  # GPU only; XLA reads them when it starts
    setup_jax(args.host_devices, args)

    from titanax.checkpoint.lora_base import MissingBase
    from titanax.checkpoint.orbax_io import DiskFull, NoGoodCheckpoint, is_disk_full
    from titanax.plan.fit import fit_to_devices
    from titanax.train.loop import TrainingDiverged, WorkdirLocked, train

    try:  # fit: the step's memory checked against the devices' before the first step
        result = train(cfg, workdir, fit=fit_to_devices)
    except ConfigError as e:
        fail(str(e))
    except WorkdirLocked as e:  # another run holds it: retry (requeue) once it is done
        fail(str(e), EXIT_PREEMPTED)
    except (TrainingDiverged, NoGoodCheckpoint, DiskFull, MissingBase) as e:  # each names the fix
        stop(str(e))
    except OSError as e:  # metrics, logs, caches: whatever else the run writes
        if not is_disk_full(e):
            raise
        stop(f"disk full writing {e.filename or workdir} ({e.strerror}); free space and run "
             "the same command again to resume from the newest checkpoint")
    if result.preempted:
        raise SystemExit(result.exit_code)


if __name__ == "__main__":
    from launch.common import use_tcmalloc

    use_tcmalloc()
    from titanax.preemption import StartupSignals

    with StartupSignals():  # a signal before the first step: exit 75 (130: Ctrl-C), one line
        main()
