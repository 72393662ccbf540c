"""The input files prepare_data reads, and the records (documents) in each.

Formats, by file name:
  .jsonl .jsonl.gz .jsonl.zst   one JSON object per line, the text under text_key (Dolma style)
  .parquet                      a table, the text in column text_key (FineWeb style)
  .arrow                        Arrow IPC (file or stream format), the text in column text_key
  anything else                 one document per file (.txt .md .rst .py by default)
A folder written by Hugging Face `datasets`' `save_to_disk` (state.json lists its .arrow
files) is read through pyarrow directly: `datasets` is not needed.

A record is counted from 1 in file order (a line of a .jsonl, a row of a table, the whole of a
text file); `records(..., skip=k)` resumes after the k-th, which is what meta.json's
partial_input records. Each record yields the bytes of the file it accounts for, so a
progress bar over the files' sizes (compressed sizes, for compressed files) ends at 100%.
"""

from __future__ import annotations

import fnmatch
import json
import os
import pathlib

from titanax.data.errors import DataError

JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TABLES = (".parquet", ".arrow")
# Read from an input folder by default (override with --glob).
DEFAULT_EXTENSIONS = (".txt", ".md", ".rst", ".py", *JSONL, *TABLES)
_HF_STATE = "state.json"


def list_inputs(input_path: str | pathlib.Path, glob: str | None = None
                ) -> tuple[pathlib.Path, list[str]]:
    """(root, relative paths in reading order) of the files to tokenize: one file, a saved
    Hugging Face dataset (its own file order), or a folder (sorted)."""
    p = pathlib.Path(input_path)
    if p.is_file():
        return p.parent, [p.name]
    if not p.is_dir():
        raise DataError(f"--input {str(p)!r}: no such file or folder")
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(f"--input {str(p)!r}: a saved DatasetDict with splits {splits}; point "
                        f"--input at one split's folder, e.g. {p / (splits or ['train'])[0]}")
    if (p / _HF_STATE).is_file():
        return p, _hf_saved_files(p)
    rels = []
    for dirpath, dirnames, filenames in os.walk(p):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # .git and friends
        for name in filenames:
            rel = (pathlib.Path(dirpath) / name).relative_to(p).as_posix()
            if glob:
                if fnmatch.fnmatch(rel, glob) or fnmatch.fnmatch(name, glob):
                    rels.append(rel)
            elif name.endswith(DEFAULT_EXTENSIONS) and not name.startswith("."):
                rels.append(rel)
    if not rels:
        what = f"matching {glob!r}" if glob else f"with extensions {list(DEFAULT_EXTENSIONS)}"
        raise DataError(f"--input {str(p)!r}: no files {what} (use --glob to choose others)")
    return p, sorted(rels)


def _hf_saved_files(folder: pathlib.Path) -> list[str]:
    """The .arrow files of a `save_to_disk` folder, in the dataset's row order."""
    path = folder / _HF_STATE
    try:
        files = [entry["filename"] for entry in json.loads(path.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a Hugging Face save_to_disk state.json ({e!r}); point "
                        "--input at the dataset folder `save_to_disk` wrote") from None
    missing = [f for f in files if not (folder / f).is_file()]
    if not files or missing:
        raise DataError(f"{path}: lists data files {files}, missing {missing}; save the "
                        "dataset again with `save_to_disk`")
    return files


def records(root: pathlib.Path, rel: str, text_key: str, skip: int):
    """Yields (records consumed so far, text, bytes accounted for) for one input, after skip."""
    path = root / rel
    if rel.endswith(JSONL):
        yield from _jsonl(path, text_key, skip)
    elif rel.endswith(TABLES):
        yield from _table(path, text_key, skip)
    elif skip < 1:
        raw = path.read_bytes()
        yield 1, raw.decode("utf-8", errors="replace"), len(raw)


def _open_text_lines(raw):
    """A line iterator over a possibly compressed binary file object."""
    name = raw.name
    if name.endswith(".gz"):
        import gzip

        return gzip.GzipFile(fileobj=raw)
    if name.endswith(".zst"):
        import io

        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return raw


def _jsonl(path: pathlib.Path, text_key: str, skip: int):
    with open(path, "rb") as raw:
        lines, seen = _open_text_lines(raw), 0
        try:
            for lineno, line in enumerate(lines, 1):
                pos = raw.tell()  # compressed bytes read so far: the progress bar's unit
                nbytes, seen = pos - seen, pos
                if lineno <= skip:
                    continue
                yield lineno, _json_text(path, lineno, line, text_key), nbytes
        except (OSError, EOFError) as e:  # gzip/zstd: truncated or corrupt stream
            raise DataError(f"{path}: cannot decompress ({e}); download it again") from None


def _json_text(path: pathlib.Path, lineno: int, line: bytes, text_key: str) -> str:
    if not line.strip():
        return ""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
    if not isinstance(obj, dict) or text_key not in obj:
        keys = list(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{path}:{lineno}: no {text_key!r} field (found {keys}); pass --text-key")
    value = obj[text_key]
    return "" if value is None else str(value)


def _table(path: pathlib.Path, text_key: str, skip: int):
    """Rows of a parquet or Arrow file, reading only the text column, batch by batch."""
    batches, n_rows = _column_batches(path, text_key)
    size = path.stat().st_size
    row, accounted = 0, 0
    for column in batches:
        if row + len(column) <= skip:  # resuming: whole batches before the point are skipped
            row += len(column)
            continue
        for value in column.to_pylist():
            row += 1
            # Bytes in proportion to rows: the file's size is spread evenly over its rows.
            nbytes = size * row // max(n_rows, 1) - accounted
            accounted += nbytes
            if row > skip:
                yield row, "" if value is None else str(value), nbytes


def _column_batches(path: pathlib.Path, text_key: str):
    """(iterator of the text column's arrays, number of rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.name.endswith(".parquet"):
            pf = pq.ParquetFile(path)
            names, n_rows = pf.schema_arrow.names, pf.metadata.num_rows
            _need_column(path, text_key, names)
            return (b.column(0) for b in pf.iter_batches(columns=[text_key])), n_rows
        source = pa.memory_map(str(path))
        try:
            table = pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:  # save_to_disk writes the stream format
            source.seek(0)
            table = pa.ipc.open_stream(source).read_all()  # memory-mapped: no copy
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable {path.suffix} file ({e}); check the "
                        "file, or leave it out with --glob") from None
    _need_column(path, text_key, table.schema.names)
    column = table.column(text_key)
    return iter(column.chunks), table.num_rows


def _need_column(path: pathlib.Path, text_key: str, names: list[str]) -> None:
    if text_key not in names:
        raise DataError(f"{path}: no {text_key!r} column (found {names}); pass --text-key")
