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


def records(root: pathlib.Path, rel: str, text_key: str, skip: int,
            fields: tuple[str, ...] | None = None):
    """Yields (records consumed so far, text, bytes accounted for) for one input, after skip.
    fields: read examples instead of text (prepare_data --format chat|prompt_response): each
    record is then a dict of those fields ({} for a blank line), and plain text files are
    refused."""
    path = root / rel
    if rel.endswith(JSONL):
        yield from _jsonl(path, text_key, skip, fields)
    elif rel.endswith(TABLES):
        yield from _table(path, text_key, skip, fields)
    elif fields:
        raise DataError(f"{path}: examples ({', '.join(fields)}) are read from .jsonl, "
                        ".parquet or .arrow files, not from plain text; leave this file out "
                        "(--glob) or prepare it with --format text")
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


def _jsonl(path: pathlib.Path, text_key: str, skip: int, fields=None):
    with open(path, "rb") as raw:
        lines, seen = _open_text_lines(raw), 0
        try:
            for lineno, line in enumerate(lines, 1):
                pos = raw.tell()  # compressed bytes read so far: the progress bar's unit
                nbytes, seen = pos - seen, pos
                if lineno <= skip:
                    continue
                yield lineno, _json_record(path, lineno, line, text_key, fields), nbytes
        except (OSError, EOFError) as e:  # gzip/zstd: truncated or corrupt stream
            raise DataError(f"{path}: cannot decompress ({e}); download it again") from None


def _json_record(path: pathlib.Path, lineno: int, line: bytes, text_key: str, fields=None):
    """The text under text_key, or with fields the dict of those fields."""
    if not line.strip():
        return {} if fields else ""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
    for key in fields or (text_key,):
        if not isinstance(obj, dict) or key not in obj:
            keys = list(obj) if isinstance(obj, dict) else type(obj).__name__
            how = "pass --text-key" if not fields else f"--format needs {list(fields)}"
            raise DataError(f"{path}:{lineno}: no {key!r} field (found {keys}); {how}")
    if fields:
        return {k: obj[k] for k in fields}
    return text_value(obj[text_key], f"{path}:{lineno}", text_key)


def text_value(value, where: str, text_key: str) -> str:
    """A text field's value: a string (None: empty). Anything else (a list of messages, a
    number) is refused: str() of it would be tokenized as if it were text."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: --text-key {text_key!r} holds a {type(value).__name__}, not "
                        "text; for chat data pass --format chat (a list of messages), for "
                        "prompt/response pairs --format prompt_response, else choose the "
                        "--text-key that holds the text")
    return value


def _table(path: pathlib.Path, text_key: str, skip: int, fields=None):
    """Rows of a parquet or Arrow file, reading only the needed columns, batch by batch."""
    columns = list(fields or (text_key,))
    batches, n_rows = _column_batches(path, columns)
    size = path.stat().st_size
    row, accounted = 0, 0
    for batch in batches:
        if row + batch.num_rows <= skip:  # resuming: whole batches before the point skipped
            row += batch.num_rows
            continue
        values = [batch.column(i).to_pylist() for i in range(len(columns))]
        for cells in zip(*values):
            row += 1
            # Bytes in proportion to rows: the file's size is spread evenly over its rows.
            nbytes = size * row // max(n_rows, 1) - accounted
            accounted += nbytes
            if row > skip:
                record = (dict(zip(columns, cells)) if fields else
                          text_value(cells[0], f"{path} row {row}", text_key))
                yield row, record, nbytes


def _column_batches(path: pathlib.Path, columns: list[str]):
    """(iterator of record batches holding just these columns, number of rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.name.endswith(".parquet"):
            pf = pq.ParquetFile(path)
            names, n_rows = pf.schema_arrow.names, pf.metadata.num_rows
            _need_columns(path, columns, names)
            return pf.iter_batches(columns=columns), n_rows
        source = pa.memory_map(str(path))
        try:
            table = pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:  # save_to_disk writes the stream format
            source.seek(0)
            table = pa.ipc.open_stream(source).read_all()  # memory-mapped: no copy
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable {path.suffix} file ({e}); check the "
                        "file, or leave it out with --glob") from None
    _need_columns(path, columns, table.schema.names)
    return iter(table.select(columns).to_batches()), table.num_rows


def _need_columns(path: pathlib.Path, columns: list[str], names: list[str]) -> None:
    for column in columns:
        if column not in names:
            how = "pass --text-key" if len(columns) == 1 else "--format needs them"
            raise DataError(f"{path}: no {column!r} column (found {names}); {how}")
