"""The input files prepare_data reads, and the records (documents) in each.

Formats, by file name:
  .jsonl .jsonl.gz .jsonl.zst   one JSON object per line, the text under text_key (Dolma style)
  .parquet                      a table, the text in column text_key (FineWeb style)
  .arrow                        Arrow IPC (file or stream format), the text in column text_key
  anything else                 one document per file (.txt .md .rst .py by default)
A folder written by Hugging Face `datasets`' `save_to_disk` (state.json lists its .arrow
files) is read through pyarrow directly: `datasets` is not needed.
Inputs may also be URLs (s3://, gs://, hf://, https://: data/remote.py, the files streamed
through fsspec) or a Hugging Face dataset by name (data/hf_stream.py, streamed by `datasets`:
its rows are records as a table's are); all are counted and resumed alike.

A record is counted from 1 in file order (a line of a .jsonl, a row of a table, the whole of a
text file); `records(..., skip=k)` resumes after the k-th, which is what meta.json's
partial_input records. Each record yields the bytes of the file it accounts for, so a
progress bar over the files' sizes (compressed sizes, for compressed files) ends at 100%.
"""

from __future__ import annotations

import fnmatch
import gzip
import json
import os
import pathlib

from titanax.data import remote
from titanax.data.errors import DataError
from titanax.data.hf_stream import HFDataset

JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst")
TABLES = (".parquet", ".arrow")
# Read from an input folder by default (override with --glob).
DEFAULT_EXTENSIONS = (".txt", ".md", ".rst", ".py", *JSONL, *TABLES)
_HF_STATE = "state.json"


def list_inputs(input_path, glob: str | None = None) -> tuple[pathlib.Path, list[str]]:
    """(root, relative paths in reading order) of the files to tokenize: one file, a saved
    Hugging Face dataset (its own file order), or a folder (sorted). A URL's root is a
    remote.RemoteRoot; an HFDataset is its own root, with its split as the one input."""
    if isinstance(input_path, HFDataset):
        if glob:
            raise DataError(f"--glob {glob!r} chooses files of --input; {input_path.option()} "
                            "reads a whole split: leave --glob out")
        return input_path, [input_path.split]
    if remote.is_url(input_path):
        return remote.list_remote(input_path, glob, DEFAULT_EXTENSIONS)
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


def source_name(input_path) -> str:
    """The input as meta.json records it (a resumed run must name the same one): a local
    path resolved, a URL or a Hugging Face dataset as given."""
    if isinstance(input_path, HFDataset) or remote.is_url(input_path):
        return str(input_path)
    return str(pathlib.Path(input_path).resolve())


def input_label(input_path) -> str:
    """How messages name the input: the option that gave it."""
    return input_path.option() if isinstance(input_path, HFDataset) else f"--input {input_path}"


def input_size(root, rel: str) -> int | None:
    """Bytes of one input for the progress bar; None where unknown (a streamed dataset, a
    server that gives no size)."""
    if isinstance(root, HFDataset):
        return None
    return (root / rel).stat().st_size


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
    if isinstance(root, HFDataset):
        with remote.read_errors(str(root)):
            yield from _rows(root.rows(skip), str(root), text_key, skip, fields)
        return
    path = root / rel
    if isinstance(path, remote.RemotePath):
        with remote.read_errors(str(path)):
            yield from _records(path, text_key, skip, fields)
    else:
        yield from _records(path, text_key, skip, fields)


def _records(path, text_key: str, skip: int, fields):
    # By the file's name: a URL's name leaves out its query (remote.RemotePath)
    if path.name.endswith(JSONL):
        yield from _jsonl(path, text_key, skip, fields)
    elif path.name.endswith(TABLES):
        yield from _table(path, text_key, skip, fields)
    elif fields:
        raise DataError(f"{path}: examples ({', '.join(fields)}) are read from .jsonl, "
                        ".parquet or .arrow files, not from plain text; leave this file out "
                        "(--glob) or prepare it with --format text")
    elif skip < 1:
        raw = path.read_bytes()
        check_text(path, raw)
        yield 1, raw.decode("utf-8", errors="replace"), len(raw)


# A plain-text input that is not text (a binary given by mistake: a checkpoint, an archive, a
# .bin of random bytes) is refused, naming the file: tokenized, it would become a shard of
# byte-fallback noise with no sign of it until the loss. What a MaxText/TorchTitan user
# expects: their text readers (Python's strict UTF-8, `datasets`' text builder) raise on such
# a file; a refusal keeps that, in one line. A stray invalid byte in real text (a Latin-1
# quote) stays a U+FFFD, as before: only a head with NUL bytes (what git and grep call binary)
# or with more than 1% of its characters not UTF-8 (a binary, or a whole Latin-1 file, which
# would be mostly U+FFFD where its accents were) is refused.
TEXT_HEAD_BYTES = 65536
MAX_INVALID_SHARE = 0.01


def check_text(path, raw: bytes) -> None:
    """DataError when the first TEXT_HEAD_BYTES of a plain-text input hold a NUL byte or more
    than MAX_INVALID_SHARE of characters that are not UTF-8."""
    head = raw[:TEXT_HEAD_BYTES]
    if not head:
        return
    if len(head) < len(raw):  # a character cut at the end of the head is not an error
        head = head[:len(head) - _partial_tail(head)]
    text = head.decode("utf-8", errors="replace")
    invalid = text.count("\ufffd") - head.decode("utf-8", errors="ignore").count("\ufffd")
    if b"\0" in head or invalid > MAX_INVALID_SHARE * max(len(text), 1):
        why = ("NUL bytes" if b"\0" in head else
               f"{invalid} invalid UTF-8 sequences among {len(text):,} characters")
        raise DataError(f"{path}: not UTF-8 text ({why} in its first {len(head):,} bytes), "
                        "so it would be tokenized as noise; leave it out of --input (--glob "
                        "chooses the files of a folder), or convert it to UTF-8 text")


def _partial_tail(head: bytes) -> int:
    """How many bytes at the end of head start a UTF-8 character that goes on past it."""
    for k in range(1, min(4, len(head)) + 1):
        b = head[-k]
        if b & 0xC0 != 0x80:  # the lead byte of the last character: how long it says it is
            need = next((n for n, (m, v) in enumerate(
                ((0xE0, 0xC0), (0xF0, 0xE0), (0xF8, 0xF0)), 2) if b & m == v), 1)
            return k if need > k else 0
    return 0


def _open_text_lines(raw, name: str):
    """A line iterator over a possibly compressed binary file object."""
    if name.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw)
    if name.endswith(".zst"):
        import io

        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw))
    return raw


def _jsonl(path: pathlib.Path, text_key: str, skip: int, fields=None):
    with path.open("rb") as raw:  # a local file, or a remote one streamed in blocks
        lines, seen = _open_text_lines(raw, path.name), 0
        try:
            for lineno, line in enumerate(lines, 1):
                pos = raw.tell()  # compressed bytes read so far: the progress bar's unit
                nbytes, seen = pos - seen, pos
                if lineno <= skip:
                    continue
                yield lineno, _json_record(path, lineno, line, text_key, fields), nbytes
        except (OSError, EOFError) as e:  # gzip/zstd: truncated or corrupt stream
            if isinstance(path, remote.RemotePath) and \
                    not isinstance(e, (EOFError, gzip.BadGzipFile)):
                raise  # a transfer failing, not the data: remote.read_errors words it
            raise DataError(f"{path}: cannot decompress ({e}); download it again") from None


def _json_record(path: pathlib.Path, lineno: int, line: bytes, text_key: str, fields=None):
    """The text under text_key, or with fields the dict of those fields."""
    if not line.strip():
        return {} if fields else ""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
    return _object_record(obj, f"{path}:{lineno}", text_key, fields)


def _object_record(obj, where: str, text_key: str, fields=None):
    """A JSON object's (or a streamed dataset row's) text under text_key, or with fields the
    dict of those fields."""
    for key in fields or (text_key,):
        if not isinstance(obj, dict) or key not in obj:
            keys = list(obj) if isinstance(obj, dict) else type(obj).__name__
            how = "pass --text-key" if not fields else f"--format needs {list(fields)}"
            raise DataError(f"{where}: no {key!r} field (found {keys}); {how}")
    if fields:
        return {k: obj[k] for k in fields}
    return text_value(obj[text_key], where, text_key)


def _rows(rows, where: str, text_key: str, skip: int, fields=None):
    """Records of a streamed dataset: its rows after the first skip, counted from 1. The
    bytes a row accounts for are its text's (the stream's size is unknown)."""
    for row, obj in enumerate(rows, skip + 1):
        record = _object_record(obj, f"{where} row {row}", text_key, fields)
        size = len(record) if isinstance(record, str) else len(json.dumps(record, default=str))
        yield row, record, size


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
    size = path.stat().st_size or 0
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
    """(iterator of record batches holding just these columns, number of rows). A remote
    file is read through its stream: parquet fetches the row groups as they are iterated;
    an Arrow file is read whole, one file at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    local = isinstance(path, pathlib.Path)
    try:
        if path.name.endswith(".parquet"):
            pf = pq.ParquetFile(path if local else path.open("rb"))
            names, n_rows = pf.schema_arrow.names, pf.metadata.num_rows
            _need_columns(path, columns, names)
            return pf.iter_batches(columns=columns), n_rows
        source = pa.memory_map(str(path)) if local else pa.PythonFile(path.open("rb"), "r")
        try:
            table = pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:  # save_to_disk writes the stream format
            source.seek(0)
            table = pa.ipc.open_stream(source).read_all()  # memory-mapped: no copy
    except (pa.ArrowException, OSError) as e:
        if not local and not isinstance(e, pa.ArrowException):
            raise  # a transfer failing, not the data: remote.read_errors words it
        raise DataError(f"{path}: not a readable {path.suffix} file ({e}); check the "
                        "file, or leave it out with --glob") from None
    _need_columns(path, columns, table.schema.names)
    return iter(table.select(columns).to_batches()), table.num_rows


def _need_columns(path: pathlib.Path, columns: list[str], names: list[str]) -> None:
    for column in columns:
        if column not in names:
            how = "pass --text-key" if len(columns) == 1 else "--format needs them"
            raise DataError(f"{path}: no {column!r} column (found {names}); {how}")
