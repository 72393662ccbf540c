"""Token shard folders: the on-disk format, its validation, and the resumable writer.

A folder holds
  meta.json            format/version, vocab_size, eos_id, bos_id, bos (whether each document
                       starts with bos_id; absent in older folders: false), tokenizer_sha256,
                       source, shards [{file, n_tokens, n_docs, max_id}], done_inputs (inputs
                       whose documents are all in listed shards), partial_input ({path,
                       records} or null: how far into one input the listed shards reach)
  shard_00000.npy ...  uint32 1-D, documents concatenated, each followed by eos (and, with
                       bos, preceded by bos)
  tokenizer.json       a copy of the tokenizer that wrote them
Fine-tuning examples (prepare_data --format chat|prompt_response; meta.json data_format,
train_on, template_sha256) add per shard, listed in its entry:
  mask_00000.npy       uint8, one per token: 1 where the loss bears on the token as a target
  offsets_00000.npy    int64 [n_docs + 1]: where each example starts (no eos is added: the
                       template ends each turn itself)

A shard only exists under its final name once completely written (temp name, then rename),
and it only counts once meta.json lists it; meta.json itself is replaced atomically. So a run
killed at any point resumes from the last listed shard and never trusts a partial file.
Shards are read memory-mapped with allow_pickle=False: a shard can never run code.
Start-up reads no tokens: each shard's largest id (max_id, checked against model.vocab_size)
is written with it; a folder from before max_id is read once and meta.json updated.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import shutil
import sys

import numpy as np

from titanax.data.chat import ChatTemplate
from titanax.data.errors import DataError
from titanax.data.examples import FIELDS, FORMATS, ExampleEncoder
from titanax.data.readers import input_label, input_size, list_inputs, records, source_name

__all__ = ["DataError", "list_inputs", "prepare_shards", "open_shards", "open_example_arrays",
           "read_meta"]

FORMAT = "titanax-token-shards"
VERSION = 1
META = "meta.json"
_FIX = "re-run `python -m launch.prepare_data` into a fresh --out folder"


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.npy"


# --- atomic writes -----------------------------------------------------------------------------

def _tmp_name(path: pathlib.Path) -> pathlib.Path:
    # Per-process temp names: several hosts sharing a folder never write into the same file.
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def save_npy_atomic(path: str | pathlib.Path, array: np.ndarray) -> None:
    path = pathlib.Path(path)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:  # a file object stops np.save from appending ".npy"
            np.save(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as e:  # a full disk: the partial file would hold the space it lacks
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno is None and \
                shutil.disk_usage(path.parent).free < array.nbytes + (1 << 16):
            # numpy reports a short write ("N requested and M written") without an errno
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        raise
    os.replace(tmp, path)


def write_json_atomic(path: str | pathlib.Path, obj) -> None:
    path = pathlib.Path(path)
    tmp = _tmp_name(path)
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def file_sha256(path: str | pathlib.Path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


# --- reading -----------------------------------------------------------------------------------

def read_meta(folder: str | pathlib.Path) -> dict:
    folder = pathlib.Path(folder)
    path = folder / META
    if not folder.is_dir():
        raise DataError(f"data.source: {str(folder)!r} is neither 'embedded', 'synthetic' nor a "
                        "folder; write token shards with `python -m launch.prepare_data`")
    if not path.is_file():
        raise DataError(f"{path}: missing, so {folder} is not a token shard folder; write one "
                        "with `python -m launch.prepare_data --out ...`")
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable ({e}); {_FIX}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path}: not a {FORMAT} meta.json; {_FIX}")
    if meta.get("version") != VERSION:
        raise DataError(f"{path}: format version {meta.get('version')}, this code reads "
                        f"{VERSION}; {_FIX}")
    return meta


def open_shards(folder: str | pathlib.Path, vocab_size: int | None = None
                ) -> tuple[dict, list[np.ndarray]]:
    """Validates every listed shard and returns (meta, memory-mapped 1-D token arrays).

    vocab_size: model.vocab_size; every token id must be below it (each shard's max_id).
    """
    folder = pathlib.Path(folder)
    meta = read_meta(folder)
    if not meta.get("shards"):
        raise DataError(f"{folder / META}: lists no shards (was prepare_data interrupted "
                        "before its first shard?); re-run the same prepare_data command")
    if vocab_size is not None and meta.get("vocab_size", 0) > vocab_size:
        raise DataError(f"model.vocab_size: {folder} was tokenized with a "
                        f"{meta['vocab_size']}-token vocabulary but model.vocab_size="
                        f"{vocab_size}; set model.vocab_size >= {meta['vocab_size']}")
    arrays = [_open_shard(folder, entry) for entry in meta["shards"]]
    if vocab_size is not None:
        _scan_unrecorded(folder, meta, arrays)
        for entry in meta["shards"]:
            if entry["max_id"] >= vocab_size:
                raise DataError(f"{folder / entry['file']}: max id {entry['max_id']} is "
                                f"outside [0, model.vocab_size={vocab_size}); set "
                                f"model.vocab_size > {entry['max_id']} or re-tokenize with a "
                                "tokenizer that fits the model")
    return meta, arrays


def open_example_arrays(folder: str | pathlib.Path, meta: dict
                        ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(masks, offsets) of an example folder's shards, memory-mapped and checked against the
    shards' sizes; DataError for a text folder (it has no loss masks)."""
    folder = pathlib.Path(folder)
    if meta.get("data_format", "text") == "text":
        raise DataError(f"{folder}: holds text documents, with no loss masks; write fine-tuning "
                        "examples with `python -m launch.prepare_data --format chat` (or "
                        "prompt_response) into a fresh --out folder")
    masks, offsets = [], []
    for entry in meta["shards"]:
        for key, out in (("mask", masks), ("offsets", offsets)):
            path = folder / entry.get(key, f"<{key} missing from {META}>")
            try:
                arr = np.load(path, mmap_mode="r", allow_pickle=False)
            except Exception as e:  # missing, truncated, not .npy
                raise DataError(f"{path}: unreadable ({type(e).__name__}: {e}); {_FIX}") from None
            out.append(arr)
        n = entry["n_tokens"]
        if masks[-1].shape != (n,) or offsets[-1].shape != (entry["n_docs"] + 1,) \
                or int(offsets[-1][-1]) != n:
            raise DataError(f"{folder / entry['file']}: its mask or offsets do not match its "
                            f"{n} tokens and {entry['n_docs']} examples; {_FIX}")
    return masks, offsets


def _scan_unrecorded(folder: pathlib.Path, meta: dict, arrays: list[np.ndarray]) -> None:
    """Shards listed without max_id (written before titanax recorded it) are read once, and
    their max_id written into meta.json so that later start-ups read no tokens."""
    todo = [i for i, entry in enumerate(meta["shards"]) if "max_id" not in entry]
    if not todo:
        return
    n_tokens = sum(arrays[i].size for i in todo)
    print(f"titanax: {folder / META} does not record the largest token id of {len(todo)} "
          f"shard(s); reading their {n_tokens:,} tokens once to check them against "
          "model.vocab_size", file=sys.stderr, flush=True)
    for i in todo:
        arr, path = arrays[i], folder / meta["shards"][i]["file"]
        lo = int(arr.min())
        if lo < 0:
            raise DataError(f"{path}: token id {lo} is negative; {_FIX}")
        meta["shards"][i]["max_id"] = int(arr.max())
    try:  # from disk again: keep whatever else changed in it meanwhile
        on_disk = read_meta(folder)
        known = {(e["file"], e.get("n_tokens")): e["max_id"] for e in meta["shards"]}
        for entry in on_disk.get("shards", []):
            key = (entry["file"], entry.get("n_tokens"))
            if "max_id" not in entry and key in known:
                entry["max_id"] = known[key]
        write_json_atomic(folder / META, on_disk)
    except OSError as e:
        print(f"titanax: could not record them in {folder / META} ({e.strerror or e}); every "
              "start-up will read them again (make the folder writable, or copy it)",
              file=sys.stderr, flush=True)
        return
    print(f"titanax: recorded max_id in {folder / META}", file=sys.stderr, flush=True)


def _open_shard(folder: pathlib.Path, entry: dict) -> np.ndarray:
    path = folder / entry["file"]
    if not path.is_file():
        raise DataError(f"{path}: listed in {META} but missing; restore it or {_FIX}")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as e:  # truncated header, pickled object arrays, not .npy at all...
        raise DataError(f"{path}: unreadable or corrupt ({type(e).__name__}: {e}); "
                        f"delete it and {_FIX}") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise DataError(f"{path}: dtype {arr.dtype} is not an integer type; token shards hold "
                        f"uint32 ids; {_FIX}")
    if arr.ndim != 1:
        raise DataError(f"{path}: shape {arr.shape}, expected a 1-D token array; {_FIX}")
    if arr.size == 0:
        raise DataError(f"{path}: empty shard (0 tokens); delete it from {META} or {_FIX}")
    if "n_tokens" in entry and entry["n_tokens"] != arr.size:
        raise DataError(f"{path}: holds {arr.size} tokens but {META} says {entry['n_tokens']} "
                        f"(truncated or replaced?); {_FIX}")
    return arr


# --- writing (launch/prepare_data.py) ----------------------------------------------------------

def prepare_shards(tokenizer_path: str | pathlib.Path, input_path,
                   out_dir: str | pathlib.Path, shard_tokens: int = 50_000_000,
                   text_key: str = "text", glob: str | None = None, progress: bool = True,
                   batch_chars: int = 4_000_000, bos: bool = False, fmt: str = "text",
                   train_on: str = "assistant") -> dict:
    """Tokenizes input into a shard folder, resuming an interrupted run. Returns meta.

    input_path: a local file or folder, a URL (s3://, gs://, hf://, https://; streamed through
    fsspec), or a hf_stream.HFDataset (a Hugging Face dataset by name, streamed).

    bos: each document starts with the tokenizer's BOS token (meta.json records it).
    fmt: 'text' (documents), or 'chat' / 'prompt_response' (fine-tuning examples, each with
    its loss mask: data/examples.py); train_on: the examples' loss on 'assistant' turns or
    'all' tokens."""
    from tqdm import tqdm

    from titanax.data.tokenizer import Tokenizer

    if shard_tokens <= 0:
        raise DataError(f"--shard-tokens must be > 0, got {shard_tokens}")
    out = pathlib.Path(out_dir)
    tok = Tokenizer.load(tokenizer_path)
    encoder = _example_encoder(fmt, tok, tokenizer_path, train_on, bos)
    if bos and encoder is None:
        tok.require_bos("--bos")
    root, rels = list_inputs(input_path, glob)
    identity = {"tokenizer_sha256": file_sha256(tokenizer_path),
                "source": source_name(input_path), "text_key": text_key,
                "glob": glob, "bos": bos,
                **(encoder.identity() if encoder else {"data_format": "text"})}
    if not (out / META).is_file():  # a bad --format / --text-key: refused, nothing written
        _check_first_record(root, rels, text_key, encoder)
    meta = _start_or_resume(out, tok, identity)
    shutil.copyfile(tokenizer_path, _tmp_name(out / "tokenizer.json"))
    os.replace(_tmp_name(out / "tokenizer.json"), out / "tokenizer.json")

    done = set(meta["done_inputs"])
    partial = meta["partial_input"]
    todo = [r for r in rels if r not in done]
    sizes = [input_size(root, r) for r in todo]
    total_bytes = None if None in sizes else sum(sizes)  # None: a bar without a total
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing",
               disable=not progress)
    writer = _ShardWriter(out, meta, shard_tokens, tok.eos_id, tok.bos_id if bos else None,
                          encoder=encoder, root=root)
    fields = FIELDS[fmt] if encoder else None

    def events():
        for rel in todo:
            skip = partial["records"] if partial and partial["path"] == rel else 0
            for consumed, rec, nbytes in records(root, rel, text_key, skip, fields):
                bar.update(nbytes)
                if rec if fields else rec.strip():
                    yield ("doc", rel, consumed, rec)
            yield ("end", rel, None, None)

    batch, chars = [], 0
    for ev in events():
        batch.append(ev)
        chars += len(ev[3]) if isinstance(ev[3], str) else 256 if ev[3] else 0
        if chars >= batch_chars or len(batch) >= 4096:
            writer.add(batch, tok)
            batch, chars = [], 0
    writer.add(batch, tok)
    writer.flush()
    bar.close()
    if not writer.meta["shards"]:
        what = (f"--format {fmt} example ({', '.join(FIELDS[fmt])})" if encoder else
                f"document with text (--text-key {text_key!r}")
        raise DataError(f"{input_label(input_path)}: no {what}"
                        f"{f', --glob {glob!r}' if glob else ''}); check them and run again "
                        "(this folder is started afresh)")
    # Every input is in a listed shard: training takes the folder without data.allow_partial.
    writer.meta["complete"] = True
    write_json_atomic(out / META, writer.meta)
    return writer.meta


_BEFORE_RECORDED = {"bos": False, "data_format": "text", "train_on": None,
                    "template_sha256": None}


def _example_encoder(fmt: str, tok, tokenizer_path, train_on: str, bos: bool):
    """The ExampleEncoder of an example format (its template from the tokenizer's folder), or
    None for text."""
    if fmt == "text":
        return None
    if fmt not in FORMATS:
        raise DataError(f"--format {fmt!r}: one of {list(FORMATS)}")
    template = ChatTemplate.from_folder(pathlib.Path(tokenizer_path).parent)
    return ExampleEncoder(fmt, tok, template, train_on, bos)


def _check_first_record(root: pathlib.Path, rels: list[str], text_key: str, encoder) -> None:
    """Reads and encodes the first record with content, so that a wrong --text-key or
    --format fails before the output folder exists."""
    fields = FIELDS[encoder.fmt] if encoder else None
    for rel in rels:
        for consumed, rec, _ in records(root, rel, text_key, 0, fields):
            if encoder is not None and rec:
                encoder.encode(rec, f"{root / rel}:{consumed}")
                return
            if encoder is None and rec.strip():
                return


def _holds_work(meta: dict) -> bool:
    return bool(meta.get("shards") or meta.get("done_inputs") or meta.get("partial_input"))


def _start_or_resume(out: pathlib.Path, tok, identity: dict) -> dict:
    # A folder whose earlier run failed before it wrote anything (a wrong --text-key or
    # --glob) is started afresh: its settings were never used, so the corrected command runs.
    if (out / META).is_file() and _holds_work(read_meta(out)):
        meta = read_meta(out)
        for key, value in identity.items():
            # bos, data_format: folders from before they were recorded hold text without BOS
            was = meta.get(key, _BEFORE_RECORDED.get(key))
            if was != value:
                raise DataError(f"{out}: was written with {key}={was!r}, this run has "
                                f"{value!r}; use a fresh --out folder (or delete {out})")
        for stale in out.glob(".*.npy.tmp*"):
            stale.unlink()  # a shard (or its mask) whose writer was killed: never counted
        return meta
    out.mkdir(parents=True, exist_ok=True)
    meta = {"format": FORMAT, "version": VERSION, "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id, "bos_id": tok.bos_id, **identity, "shards": [],
            "done_inputs": [], "partial_input": None, "complete": False}
    write_json_atomic(out / META, meta)
    return meta


class _ShardWriter:
    """Buffers tokenized documents; writes a shard (then meta.json) every ~shard_tokens.
    With an example encoder, each shard's loss mask and example offsets go beside it."""

    def __init__(self, out: pathlib.Path, meta: dict, shard_tokens: int, eos_id: int,
                 bos_id: int | None = None, *, encoder=None, root: pathlib.Path | None = None):
        # bos_id: each document starts with it (data.bos); encoder: examples, not text
        self.out, self.meta, self.shard_tokens, self.eos_id = out, meta, shard_tokens, eos_id
        self.head = [] if bos_id is None else [bos_id]
        self.encoder, self.root = encoder, root
        self.pieces: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.n_tokens = 0
        self.n_docs = 0
        self.ended: list[str] = []
        self.partial = meta["partial_input"]

    def _encoded(self, batch: list[tuple], tok):
        """Per "doc" event: (ids, mask or None)."""
        if self.encoder is not None:
            return (self.encoder.encode(ev[3], f"{self.root / ev[1]}:{ev[2]}")
                    for ev in batch if ev[0] == "doc")
        texts = [ev[3] for ev in batch if ev[0] == "doc"]
        return ((np.asarray(self.head + ids + [self.eos_id], np.uint32), None)
                for ids in (tok.encode_batch(texts) if texts else ()))

    def add(self, batch: list[tuple], tok) -> None:
        encoded = iter(self._encoded(batch, tok))
        for kind, rel, consumed, _ in batch:
            if kind == "end":
                self.ended.append(rel)
                if self.partial and self.partial["path"] == rel:
                    self.partial = None
                continue
            ids, mask = next(encoded)
            self.pieces.append(ids)
            if mask is not None:
                self.masks.append(mask)
            self.n_tokens += len(ids)
            self.n_docs += 1
            self.partial = {"path": rel, "records": consumed}
            if self.n_tokens >= self.shard_tokens:
                self.flush()

    def flush(self) -> None:
        """Writes the buffered documents as the next shard, then records it in meta.json."""
        if self.n_tokens:
            index = len(self.meta["shards"])
            tokens = np.concatenate(self.pieces)
            save_npy_atomic(self.out / shard_name(index), tokens)
            # max_id: training checks the ids against model.vocab_size without reading them
            entry = {"file": shard_name(index), "n_tokens": self.n_tokens,
                     "n_docs": self.n_docs, "max_id": int(tokens.max())}
            if self.encoder is not None:
                entry.update(self._write_examples(index))
            self.meta["shards"].append(entry)
        elif not self.ended and self.partial == self.meta["partial_input"]:
            return  # nothing new to record
        self.meta["done_inputs"] = sorted(set(self.meta["done_inputs"]) | set(self.ended))
        self.meta["partial_input"] = self.partial
        write_json_atomic(self.out / META, self.meta)
        self.pieces, self.masks, self.n_tokens, self.n_docs, self.ended = [], [], 0, 0, []

    def _write_examples(self, index: int) -> dict:
        """The shard's loss mask (uint8 per token) and example offsets (int64, n_docs + 1),
        written before meta.json lists the shard."""
        mask = np.concatenate(self.masks)
        offsets = np.cumsum([0] + [len(p) for p in self.pieces], dtype=np.int64)
        names = {"mask": f"mask_{index:05d}.npy", "offsets": f"offsets_{index:05d}.npy"}
        save_npy_atomic(self.out / names["mask"], mask)
        save_npy_atomic(self.out / names["offsets"], offsets)
        return {**names, "n_loss_tokens": int(mask.sum())}
