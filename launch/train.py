"""python -m launch.train [--config FILE.py|FILE.gin] [--set section.field=value ...]
                          [--workdir DIR] [--host-devices N] [--help-config]
                          [--coordinator HOST:PORT --num-processes N --process-id I]

Without --config: the config saved in WORKDIR/config.json when there is one (an import or an
earlier run), else configs/tiny.py (for a new or empty workdir; one that holds files but no
config.json is refused); --set applies on top either way, and turns off the saved field that
would decide instead of it (--set train.steps over a saved train.epochs), saying so.

Exit status: 0 when train.steps are done, 75 (EX_TEMPFAIL) when stopped by SIGTERM/SIGUSR1
after saving a checkpoint, or during start-up before the first step (nothing to save), or when
another live run holds the workdir's lock (rerun the same command, or requeue the job, to
resume), 130 when stopped by Ctrl-C (saved the same way; a second Ctrl-C stops without
saving), 1 when
training diverged or a process was lost, 2 for a configuration error (a train step that
does not fit the devices' memory is one: the error names the --set that fits; so are a
train.steps below the checkpoint's step, a logger that cannot start, and a workdir with files
but no config.json given without --config)."""

from __future__ import annotations

import argparse
import fnmatch
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


def _base_config(args, notes: list[str] | None = None):
    """--config with --set; without --config, the workdir's own config.json (written by
    launch.import_hf or an earlier run: `launch.train --workdir W` continues W as it was
    configured) or configs/tiny.py for a new run (an empty or new folder: one that holds
    files but no config.json is refused, nothing of it a titanax run's). An explicit --set
    turns off the field that would decide instead of it (train.epochs for train.steps,
    config/overrides.py RIVALS); notes gets the line saying so."""
    from titanax.config import ConfigError, apply_overrides, load_config

    saved = pathlib.Path(args.workdir) / "config.json" if args.workdir else None
    if args.config is not None:
        return load_config(args.config, args.overrides, notes=notes)
    if saved is None or not saved.is_file():
        if saved is not None:
            _refuse_foreign_folder(saved.parent)
        return load_config(DEFAULT_CONFIG, args.overrides, notes=notes)
    try:  # the saved config alone: only its own errors are fixed by --config FILE
        cfg = load_config(saved)
    except ConfigError as e:
        raise ConfigError(f"{e}; give --config FILE") from None
    try:  # a bad --set names its key and what it takes
        return apply_overrides(cfg, args.overrides, notes=notes, base="the saved")
    except TypeError as e:
        raise ConfigError(str(e)) from None


def _left_by_a_start(path: pathlib.Path) -> bool:
    from titanax.train.workdir_lock import LOCK_NAME

    if path.is_dir():
        return not any(path.iterdir())
    # The embedded corpus's tokenizer is the pair tokenizer.json + tokenizer_meta.json
    # (data/tokenizer.py); a tokenizer.json alone is someone else's (an import's).
    trained = (path.parent / "tokenizer_meta.json").is_file()
    return (path.name == LOCK_NAME
            or path.suffix in (".log", ".out", ".err")  # a job's own output sent here
            or (trained and path.name in ("tokenizer.json", "tokenizer_meta.json"))
            or fnmatch.fnmatch(path.name, "embedded_tokens_*.npy")
            or fnmatch.fnmatch(path.name, ".config.json.*.tmp"))


def _refuse_foreign_folder(workdir: pathlib.Path) -> None:
    """A workdir that holds files but no config.json (an import killed before it wrote one,
    a folder of the user's own) is not trained on with configs/tiny.py."""
    from titanax.config import ConfigError

    if not workdir.is_dir():
        return
    # What a refused start leaves is nothing: the lock, an empty checkpoints/ or cache folder,
    # and the embedded corpus's tokenizer and token cache (written before config.json); nor is
    # a log the job writes beside its run (train.log, slurm-*.out).
    held = sorted(p.name for p in workdir.iterdir() if not _left_by_a_start(p))
    if held:
        names = ", ".join(held[:3]) + (f", ... ({len(held)} entries)" if len(held) > 3 else "")
        raise ConfigError(f"--workdir {workdir} holds files ({names}) but no config.json: "
                          "not a run to continue (an import killed before it finished?), and "
                          f"without --config {DEFAULT_CONFIG.name} would train there; give "
                          "--config FILE to train in it, or an empty (or new) folder")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__)
    add_config_flags(p, default_config=None)
    add_host_devices_flag(p)
    add_distributed_flags(p)
    p.add_argument("--workdir", default=None, help="run folder (default runs/<config name>)")
    p.add_argument("--help-config", action="store_true",
                   help="list every config field (section.field = default, one line each) "
                   "and exit; with --config, --set or a run's --workdir, that config's values")
    args = p.parse_args(argv)
    from titanax.config import ConfigError

    if args.help_config:
        from titanax.config.describe import describe_config

        saved = args.workdir and (pathlib.Path(args.workdir) / "config.json").is_file()
        if args.config is None and not args.overrides and not saved:
            print(describe_config())  # the defaults
            return
        try:
            cfg = _base_config(args)
        except ConfigError as e:
            fail(str(e))
        source = (args.config or (f"{args.workdir}/config.json" if saved else
                                  str(DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[1]))))
        sets = "".join(f" --set {o}" for o in args.overrides)
        print(describe_config(cfg, f"{source}{sets}"))
        return

    notes: list[str] = []
    try:
        cfg = _base_config(args, notes)
    except ConfigError as e:
        fail(str(e))
    for line in notes:  # an explicit --set over the field that would have decided instead
        print(f"titanax: {line}", flush=True)
    workdir = args.workdir or f"runs/{pathlib.Path(args.config or DEFAULT_CONFIG).stem}"
    from titanax import xla_flags

    xla_flags.apply_for_run(args.host_devices)  # GPU only; XLA reads them when it starts
    setup_jax(args.host_devices, args)

    from titanax.checkpoint.disk_full import DiskFull, is_disk_full
    from titanax.checkpoint.fallback import NoGoodCheckpoint
    from titanax.checkpoint.lora_base import MissingBase
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
