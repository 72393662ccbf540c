"""A checkpoint that does not fit on its disk, said once: DiskFull (launch.train, import_hf and
export_hf print it as one `error:` line, exit 1), how a failure is recognised as a full disk
(is_disk_full), the message naming the folder, the bytes a checkpoint needs and those free,
and the removal of the step's partial folder. orbax's own tracebacks of the failure (one per
save thread) are filtered out of the log.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import shutil

import jax


class DiskFull(RuntimeError):
    """A checkpoint does not fit where it is written (launch.train: one line, exit 1). The
    step's partial folder is removed; the committed steps are untouched."""


def is_disk_full(e: BaseException) -> bool:
    """Does e (or what caused it) say the filesystem is full? orbax reports tensorstore's
    ENOSPC as a ValueError 'RESOURCE_EXHAUSTED: ... Failed writing'."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text or (
                "RESOURCE_EXHAUSTED" in text and "writ" in text):
            return True
        e = e.__cause__ or e.__context__
    return False


class _DiskFullRecords(logging.Filter):
    """Drops orbax's own reports of a full disk: every one of its save threads logs the
    failure with a traceback (hundreds of lines for one save), and the run says it once, as
    DiskFull, when it notices."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ((exc is not None and is_disk_full(exc))
                    or "RESOURCE_EXHAUSTED" in str(record.msg))


logging.getLogger("absl").addFilter(_DiskFullRecords())


def tree_bytes(tree) -> int:
    """Bytes of every array in tree (global sizes: what a checkpoint of it writes)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree)
               if hasattr(x, "dtype") and hasattr(x, "size"))


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} bytes"


def remove_partial(directory: pathlib.Path, step: int | None) -> None:
    """Removes the step's partial folder (never a step: orbax commits by renaming it)."""
    if jax.process_index() == 0 and step is not None:
        for partial in directory.glob(f"{step}.orbax-checkpoint-tmp*"):
            shutil.rmtree(partial, ignore_errors=True)


def disk_full(directory: pathlib.Path, step: int | None, needed: int, free: int,
              last: int | None) -> DiskFull:
    """The DiskFull of a save of `step` into directory: a checkpoint needs `needed` bytes,
    `free` are free there, `last` is the newest complete step (None: none)."""
    newest = (f"the newest complete checkpoint is step {last}" if last is not None else
              "no checkpoint was completed")
    inodes = "" if os.statvfs(directory).f_favail else ", but no free inodes"
    return DiskFull(
        f"disk full: the checkpoint of step {step} does not fit in {directory} "
        f"(a checkpoint of this run needs {_size(needed)}, "
        f"{_size(free)} are free there{inodes}); {newest}. Free space (or lower checkpoint.keep) "
        "and run the same command again to resume from it")
