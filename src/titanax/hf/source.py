"""What an import keeps of the source HF folder, and how export writes it back.

A published checkpoint says more than titanax's config holds: generation defaults (an Instruct
model's eos list such as [128001, 128008, 128009] and its sampling settings), the context
length it supports (max_position_embeddings, often larger than the length we train at) and
config.json keys titanax does not interpret. Import copies config.json and
generation_config.json to WORKDIR/hf_source/ (the tokenizer files go to WORKDIR/hf_tokenizer/,
hf/tokenizer.py); export starts from the saved config.json and overwrites only the keys its
architecture writes, so every other key survives export -> import -> export unchanged.
"""

from __future__ import annotations

import json
import pathlib
import shutil

SOURCE_DIR = "hf_source"
KEPT_FILES = ("config.json", "generation_config.json")
# Keys the architecture's to_config writes that say nothing about the weights titanax holds:
# the source's values are kept (titanax would only write defaults for them).
_SOURCE_WINS = ("initializer_range", "use_cache", "attention_dropout", "pretraining_tp",
                "bos_token_id", "eos_token_id")


# Where the imported weights came from (a hub id or a folder): a LoRA run's PEFT export names
# it as the adapter's base_model_name_or_path.
ORIGIN_FILE = "origin.json"


def keep_source(hf_dir: pathlib.Path, workdir: pathlib.Path,
                origin: tuple[str, str | None] | None = None) -> list[pathlib.Path]:
    """Copies the source's config.json and generation_config.json (byte for byte) into
    WORKDIR/hf_source/, and records `origin`: (hub id, commit) of a hub import, by default
    (the folder's absolute path, None); returns the copies."""
    out = workdir / SOURCE_DIR
    out.mkdir(parents=True, exist_ok=True)
    name, revision = origin or (str(pathlib.Path(hf_dir).absolute()), None)
    (out / ORIGIN_FILE).write_text(json.dumps({"name_or_path": name, "revision": revision})
                                   + "\n")
    kept = []
    for name in KEPT_FILES:
        if (hf_dir / name).is_file():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(hf_dir / name, out / name)
            kept.append(out / name)
    return kept


def source_file(workdir: pathlib.Path, name: str) -> pathlib.Path | None:
    path = pathlib.Path(workdir) / SOURCE_DIR / name
    return path if path.is_file() else None


def source_config(workdir: pathlib.Path) -> dict | None:
    """The imported folder's config.json (None for a run that was not imported)."""
    path = source_file(workdir, "config.json")
    return json.loads(path.read_text()) if path is not None else None


def base_origin(workdir: pathlib.Path) -> tuple[str | None, str | None]:
    """(hub id or folder, hub commit or None) the run's weights were imported from; (None,
    None) when it was not imported (or imported before the origin was recorded)."""
    path = source_file(workdir, ORIGIN_FILE)
    if path is None:
        return None, None
    origin = json.loads(path.read_text())
    return origin.get("name_or_path"), origin.get("revision")


def merge_config(ours: dict, source: dict | None, max_seq_len: int,
                 source_keeps: tuple[str, ...] = ()) -> dict:
    """config.json for export: the source's keys in their order, the architecture's keys over
    them but for source_keeps (keys the architecture writes and does not use:
    HFInterop.source_keeps). max_position_embeddings stays the source's (the context the model
    supports, which training at a shorter model.max_seq_len does not shrink) unless
    max_seq_len exceeds it."""
    if source is None:
        return ours
    merged = {**source, **ours}
    for key in _SOURCE_WINS + tuple(source_keeps):
        if key in source:
            merged[key] = source[key]
    if isinstance(source.get("max_position_embeddings"), int):
        merged["max_position_embeddings"] = max(source["max_position_embeddings"], max_seq_len)
    return merged


def eos_ids(workdir: pathlib.Path, tokenizer_eos: int | None) -> list[int]:
    """Every id generation stops at: the generation_config.json eos list (or id) an import
    kept, else the config.json's, plus the tokenizer's end-of-document token."""
    ids = [] if tokenizer_eos is None else [tokenizer_eos]
    for name in ("generation_config.json", "config.json"):
        path = source_file(workdir, name)
        value = json.loads(path.read_text()).get("eos_token_id") if path else None
        if value is not None:
            ids += value if isinstance(value, list) else [value]
            break
    return sorted(set(int(i) for i in ids))
