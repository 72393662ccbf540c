"""What a GPU loan brings back: three files. The loan machine returns at most 8 files from $OUT,
each at most 16 MiB, none deeper than $OUT/a/b/file (docs/gpu_check.md), while a run writes a
log and a result file per section. So the report stays two plain files and everything else
goes into one archive, each replaced atomically after every section: a loan cut short at any
point returns what was measured up to there.
"""

from __future__ import annotations

import io
import os
import pathlib
import shutil
import tarfile

FILES = ("gpu_check.json", "gpu_check.md")
ARCHIVE = "logs.tar.gz"
MAX_FILES = 8  # what the loan machine returns
MAX_BYTES = 16 * 2**20
MAX_LOG_BYTES = 4 * 2**20  # a runaway log keeps its tail: the archive stays under MAX_BYTES


def _tail(path: pathlib.Path, limit: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        return f.read()


def pack(out: pathlib.Path, dest: pathlib.Path) -> list[pathlib.Path]:
    """out (the runner's folder) -> dest/gpu_check.json, gpu_check.md, logs.tar.gz."""
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in FILES:
        if (out / name).is_file():
            tmp = dest / f".{name}.tmp"
            shutil.copyfile(out / name, tmp)
            os.replace(tmp, dest / name)
            written.append(dest / name)
    tmp = dest / f".{ARCHIVE}.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for sub in ("logs", "sections"):
            for path in sorted((out / sub).glob("*")):
                if not path.is_file() or path.name.endswith(".tmp"):
                    continue
                data = _tail(path, MAX_LOG_BYTES)
                info = tarfile.TarInfo(f"{sub}/{path.name}")
                info.size, info.mtime = len(data), int(path.stat().st_mtime)
                tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, dest / ARCHIVE)
    return written + [dest / ARCHIVE]


def check_returnable(dest: pathlib.Path) -> list[str]:
    """What the loan machine would not return from dest: too many files, too large, too deep."""
    files = [p for p in dest.rglob("*") if p.is_file()]
    problems = []
    if len(files) > MAX_FILES:
        problems.append(f"{len(files)} files (at most {MAX_FILES} come back)")
    for p in files:
        rel = p.relative_to(dest)
        if p.stat().st_size > MAX_BYTES:
            problems.append(f"{rel}: {p.stat().st_size} bytes (at most {MAX_BYTES})")
        if len(rel.parts) > 3:
            problems.append(f"{rel}: deeper than OUT/a/b/file")
    return problems
