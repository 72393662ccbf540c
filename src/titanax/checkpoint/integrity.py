"""A manifest of every file in a committed checkpoint step (size and CRC-32), written once the
step is on disk and checked before it is restored.

Orbax writes a step into a temporary folder and renames it on commit, so a write cut short
never looks like a step. What the rename cannot catch is damage after the commit: a file
truncated by a full disk or a copy between clusters, or bytes rotted on storage. Orbax would
then fail halfway through a restore, or (for some bytes) restore garbage silently. The manifest
turns both into a clear verdict before anything is read.

Cost: one sequential read of the step (zlib's CRC-32 runs at several GB/s) on process 0, in a
background thread once a save has committed (never on the step path), and again when a run
resumes. The files are those of a shared filesystem, as orbax's multi-host saves assume.
"""

from __future__ import annotations

import json
import os
import pathlib
import zlib

MANIFEST = "titanax_manifest.json"
_CHUNK = 8 << 20


def _crc32(path: pathlib.Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: pathlib.Path):
    for p in sorted(step_dir.rglob("*")):
        if p.is_file() and not p.name.endswith(MANIFEST + ".tmp") and p.name != MANIFEST:
            yield p.relative_to(step_dir).as_posix(), p


def write_manifest(step_dir: str | pathlib.Path) -> None:
    """Records every file of a committed step; written atomically (tmp file, then rename)."""
    step_dir = pathlib.Path(step_dir)
    files = {rel: {"bytes": p.stat().st_size, "crc32": _crc32(p)} for rel, p in _files(step_dir)}
    tmp = step_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"version": 1, "files": files}, indent=1))
    os.replace(tmp, step_dir / MANIFEST)


def has_manifest(step_dir: str | pathlib.Path) -> bool:
    return (pathlib.Path(step_dir) / MANIFEST).is_file()


def find_damage(step_dir: str | pathlib.Path) -> str | None:
    """None if every file the manifest lists is present with its size and checksum, else what
    is wrong. A step without a manifest (the run died between the commit and the manifest, or
    it was written by an older version) yields None too: the restore itself is its check."""
    step_dir = pathlib.Path(step_dir)
    if not step_dir.is_dir():
        return f"{step_dir} is missing"
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError) as e:
        return f"its manifest {path} is unreadable ({e})"
    for rel, want in files.items():
        p = step_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{rel} has {size} bytes, {want['bytes']} were written"
        if _crc32(p) != want["crc32"]:
            return f"{rel} does not match its checksum"
    return None
