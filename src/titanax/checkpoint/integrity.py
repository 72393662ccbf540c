"""A manifest of every file in a committed checkpoint step (size and CRC-32), written once the
step is on disk and checked before it is restored.

Orbax writes a step into a temporary folder and renames it on commit, so a write cut short
never looks like a step. What the rename cannot catch is damage after the commit: a file
truncated by a full disk or a copy between clusters, or bytes rotted on storage. Orbax would
then fail halfway through a restore, or (for some bytes) restore garbage silently. The manifest
turns both into a clear verdict before anything is read.

Scale. A 70B step with float32 weights and Adam is ~0.85 TB: one process reading all of it
takes minutes, so the work is split and nobody waits on it:
- At save, every process checksums its share of the step's files in a background thread once
  the save has committed, and writes its part, `titanax_manifest.part-<i>-of-<n>.json`. The
  share (`owner`) is what the process wrote itself where orbax's layout says so (its
  `ocdbt.process_<i>/` folder and `array_metadatas/process_<i>`: bytes still in its host's
  page cache), the remaining files spread by a hash of their name. Every process computes the
  same shares from the names alone, so no device collective or exchange is needed (the files
  are on a shared filesystem, as orbax's multi-host saves assume).
- Whoever writes the last part merges the parts into `titanax_manifest.json`. Readers fall back
  to the union of the parts when the merged file is missing (a process died before merging, or
  the filesystem showed a part late), so the merge is a convenience, never a requirement.
- Once a stop is requested (a preemption notice: `stop` set), checksumming stops where it is and
  the part records sizes only for the files not read through: the scheduler's grace period is for
  saving, not reading back. Sizes still catch truncation; `crc32: null` marks the rest.
- Before a resume every process verifies its share (each file's size, then its checksum, on a
  few threads), and the caller agrees the verdicts (checkpoint/fallback.py).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pathlib
import re
import threading
import zlib

MANIFEST = "titanax_manifest.json"
_PREFIXES = ("titanax_manifest", ".titanax_manifest")  # merged, parts and their tmp files
_PART = "titanax_manifest.part-{index}-of-{count}.json"
_PART_RE = re.compile(r"titanax_manifest\.part-(\d+)-of-(\d+)\.json")
# orbax's per-process files: state/ocdbt.process_<i>/..., state/array_metadatas/process_<i>
_WRITER_RE = re.compile(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)")
_CHUNK = 8 << 20
_VERIFY_THREADS = 8  # parallel reads help on shared filesystems; CRC-32 itself runs ~4 GB/s


def owner(rel: str, count: int) -> int:
    """The process (of `count`) that checksums file `rel` at save and verifies it at resume."""
    m = _WRITER_RE.search(rel)
    if m:
        return int(m.group(1)) % count
    return int.from_bytes(hashlib.sha1(rel.encode()).digest()[:4], "little") % count


def part_name(index: int, count: int) -> str:
    return _PART.format(index=index, count=count)


def _crc32(path: pathlib.Path, stop=None) -> int | None:
    """The file's CRC-32; None if `stop` was set before it was read through."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            if stop is not None and stop.is_set():
                return None
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: pathlib.Path):
    for p in sorted(step_dir.rglob("*")):
        if p.is_file() and not p.name.startswith(_PREFIXES):
            yield p.relative_to(step_dir).as_posix(), p


def _write_json(path: pathlib.Path, obj) -> None:
    """Atomic (tmp file, then rename); the tmp name is the writer's own, as two processes may
    write the same merged manifest at once."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def seal(step_dir: str | pathlib.Path, index: int = 0, count: int = 1, *, stop=None) -> dict:
    """Writes process `index`'s part of the manifest of a committed step (size and CRC-32 of
    each file it owns; sizes only once `stop` is set), then merges the parts if all are there.
    stop: anything with is_set(), a threading.Event or titanax.preemption.STOPPING.
    Returns {'files', 'bytes', 'checksummed'}: what this part covers."""
    step_dir = pathlib.Path(step_dir)
    files, total, summed = {}, 0, 0
    for rel, p in _files(step_dir):
        if owner(rel, count) != index:
            continue
        size = p.stat().st_size
        crc = None if stop is not None and stop.is_set() else _crc32(p, stop)
        files[rel] = {"bytes": size, "crc32": crc}
        total += size
        summed += size if crc is not None else 0
    _write_json(step_dir / part_name(index, count),
                {"version": 2, "process": index, "processes": count, "files": files})
    merge(step_dir)
    return {"files": len(files), "bytes": total, "checksummed": summed}


def _parts(step_dir: pathlib.Path) -> dict[int, dict[int, pathlib.Path]]:
    """{process count: {index: path}} of the parts in a step folder."""
    found: dict[int, dict[int, pathlib.Path]] = {}
    for p in step_dir.glob("titanax_manifest.part-*.json"):
        m = _PART_RE.fullmatch(p.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = p
    return found


def merge(step_dir: str | pathlib.Path) -> bool:
    """Writes MANIFEST from the parts if every process's part is there; True if written."""
    step_dir = pathlib.Path(step_dir)
    for count, parts in _parts(step_dir).items():
        if sorted(parts) == list(range(count)):
            files = {}
            for i in range(count):
                files.update(json.loads(parts[i].read_text())["files"])
            _write_json(step_dir / MANIFEST,
                        {"version": 2, "processes": count, "files": dict(sorted(files.items()))})
            return True
    return False


def has_manifest(step_dir: str | pathlib.Path) -> bool:
    return (pathlib.Path(step_dir) / MANIFEST).is_file()


def load_manifest(step_dir: str | pathlib.Path) -> dict | None:
    """{rel: {'bytes', 'crc32' (None: sizes only)}} from the merged manifest, else the union of
    whatever parts exist; None when the step has neither. ValueError names an unreadable one."""
    step_dir = pathlib.Path(step_dir)
    merged = step_dir / MANIFEST
    paths = [merged] if merged.is_file() else [
        p for parts in _parts(step_dir).values() for p in parts.values()]
    if not paths:
        return None
    files = {}
    for path in paths:
        try:
            files.update(json.loads(path.read_text())["files"])
        except (ValueError, KeyError) as e:
            raise ValueError(f"its manifest {path} is unreadable ({e})") from None
    return files


def _check(step_dir: pathlib.Path, rel: str, want: dict) -> str | None:
    p = step_dir / rel
    if not p.is_file():
        return f"{rel} is missing"
    size = p.stat().st_size
    if size != want["bytes"]:
        return f"{rel} has {size} bytes, {want['bytes']} were written"
    if want.get("crc32") is not None and _crc32(p) != want["crc32"]:
        return f"{rel} does not match its checksum"
    return None


def find_damage(step_dir: str | pathlib.Path, index: int = 0, count: int = 1, *,
                threads: int = _VERIFY_THREADS) -> str | None:
    """None if every file of process `index`'s share (of `count`) that the manifest lists is
    present with its size and checksum, else what is wrong. Each process of a run checks its
    share, so all shares together cover the step; the caller agrees the verdicts. A step
    without a manifest (the run died between the commit and the manifest, or it was written by
    an older version) yields None too: the restore itself is its check."""
    step_dir = pathlib.Path(step_dir)
    if not step_dir.is_dir():
        return f"{step_dir} is missing"
    try:
        files = load_manifest(step_dir)
    except ValueError as e:
        return str(e)
    if not files:
        return None
    mine = sorted(rel for rel in files if owner(rel, count) == index)
    # Biggest first, so the threads finish together.
    mine.sort(key=lambda rel: -files[rel]["bytes"])
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        found = [d for d in pool.map(lambda rel: _check(step_dir, rel, files[rel]), mine) if d]
    if not found:
        return None
    found.sort()
    more = len(found) - 1
    more = f" (and {more} more damaged file{'s' * (more > 1)})" if more else ""
    return found[0] + more
