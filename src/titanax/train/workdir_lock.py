"""One run per workdir: an exclusive lock held by a training run for its whole life.

Two trainers on one workdir (a requeued job while the old one drains, a second terminal) would
interleave metrics.jsonl and race each other's checkpoints. The lock is a POSIX record lock
(fcntl.lockf) on WORKDIR/.titanax.lock, which the kernel drops when its process dies, however it
dies: a stale lock from a killed run is simply free, on a local disk and on shared storage
(NFS and Lustre grant fcntl locks across hosts, and release a dead client's with its lease).
The file itself is never deleted (deleting a lock file races a process that has it open); it
holds the holder's host, pid and start time, for the line the second trainer prints.

Only process 0 of a multi-process run takes it: the processes of one run share the workdir.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import pathlib
import socket

from titanax.config import ConfigError

LOCK_NAME = ".titanax.lock"


class WorkdirLocked(RuntimeError):
    """Another live run holds the workdir (launch.train exits 75: retry once it is done)."""


def _unusable(workdir: pathlib.Path, e: OSError) -> ConfigError:
    if workdir.exists() and not workdir.is_dir():
        return ConfigError(f"--workdir {workdir} is a file, not a folder; give a folder "
                           "(a new one, or a run's)")
    why = {errno.EACCES: "is not writable", errno.EPERM: "is not writable",
           errno.EROFS: "is on a read-only filesystem",
           errno.ENOSPC: "is on a full disk"}.get(e.errno, f"cannot be used ({e.strerror})")
    return ConfigError(f"--workdir {workdir} {why}: a run writes its checkpoints and metrics "
                       "there; give a writable folder")


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "another process (it has not said which yet)"
    return f"host {info.get('host')} pid {info.get('pid')} since {info.get('started')}"


@contextlib.contextmanager
def workdir_lock(workdir: str | os.PathLike, *, enabled: bool = True):
    """Holds WORKDIR's lock inside the block (creating the folder if needed). Raises
    WorkdirLocked naming the holder if a live run has it, ConfigError if the workdir cannot
    be written (a file, read-only, no permission)."""
    workdir = pathlib.Path(workdir)
    if not enabled:
        yield
        return
    created = not workdir.exists()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(workdir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise _unusable(workdir, e) from None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):
                raise WorkdirLocked(
                    f"workdir {workdir} is in use by {_holder(fd)}: one run per workdir; "
                    "wait for it to finish (a requeued job retries on exit 75) or give "
                    "another --workdir") from None
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # A filesystem without fcntl locks: run unlocked rather than not at all.
            print(f"warning: {workdir}'s filesystem does not support file locks ({e.strerror});"
                  " the workdir is not locked against a second run", flush=True)
        info = {"host": socket.gethostname(), "pid": os.getpid(),
                "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)
        yield
    finally:
        # A run refused before it wrote anything in a folder it created leaves no folder.
        if created and [p.name for p in workdir.iterdir()] == [LOCK_NAME]:
            (workdir / LOCK_NAME).unlink()
            workdir.rmdir()
        os.close(fd)  # releases the lock


def enclosing_run(path: str | os.PathLike) -> pathlib.Path | None:
    """The run folder (a workdir: it holds the lock file, or checkpoints/ and config.json)
    that `path` is, or lies inside, else None: a command writing there (launch.export_hf's
    --out, launch.eval's results) takes that run's lock (workdir_lock) as training does."""
    for folder in (pathlib.Path(path).absolute(), *pathlib.Path(path).absolute().parents):
        if (folder / LOCK_NAME).is_file() or (
                (folder / "checkpoints").is_dir() and (folder / "config.json").is_file()):
            return folder
    return None
