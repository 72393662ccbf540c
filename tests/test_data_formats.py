"""prepare_data's input formats: parquet, Arrow, .jsonl.gz/.zst and a saved HF dataset each
give byte-identical shards to the same text in .jsonl; resume inside a table file; errors."""

from __future__ import annotations

import gzip
import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tests.helpers.interrupt import killed_at_shard
from titanax.config import ConfigError
from titanax.data import shards
from titanax.data.errors import DataError
from titanax.data.readers import list_inputs
from titanax.data.tokenizer import train_bpe

# Unicode, a blank record (skipped in every format), repeated structure for several shards.
TEXTS = [f"doc {i}: héllo wörld {'ab' * (i % 5)}\n{'x = ' + str(i) * (1 + i % 4)}"
         for i in range(40)]
TEXTS[7] = ""
SHARD_TOKENS = 120


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(TEXTS * 2, 300, path)
    return path


def _jsonl_bytes(texts) -> bytes:
    return "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)).encode()


def _table(texts) -> pa.Table:
    return pa.table({"id": list(range(len(texts))), "text": texts})


def _write_stream(path: pathlib.Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=6):  # several record batches
            w.write_batch(batch)


def _hf_saved_by_hand(folder: pathlib.Path, texts) -> None:
    """The layout `Dataset.save_to_disk` writes: Arrow stream files listed in state.json."""
    folder.mkdir()
    half = len(texts) // 2
    names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    for name, part in zip(names, (texts[:half], texts[half:])):
        _write_stream(folder / name, _table(part))
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0",
        "_format_columns": None, "_format_type": None, "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {
        "id": {"dtype": "int64", "_type": "Value"},
        "text": {"dtype": "string", "_type": "Value"}}}))


def _write_formats(root: pathlib.Path) -> dict[str, pathlib.Path]:
    raw = _jsonl_bytes(TEXTS)
    paths = {k: root / f"data{k}" for k in (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet",
                                            ".arrow")}
    paths[".jsonl"].write_bytes(raw)
    paths[".jsonl.gz"].write_bytes(gzip.compress(raw))
    paths[".jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(_table(TEXTS), paths[".parquet"], row_group_size=7)
    with pa.OSFile(str(paths[".arrow"]), "wb") as sink, \
            pa.ipc.new_file(sink, _table(TEXTS).schema) as w:  # the IPC file format
        w.write_table(_table(TEXTS), max_chunksize=9)
    paths["hf"] = root / "hf_saved"
    _hf_saved_by_hand(paths["hf"], TEXTS)
    try:  # the real writer too, where the test environment has it
        import datasets
    except ImportError:
        return paths
    paths["datasets"] = root / "hf_datasets"
    datasets.Dataset.from_dict({"id": list(range(len(TEXTS))), "text": TEXTS}).save_to_disk(
        str(paths["datasets"]), max_shard_size="2KB")
    return paths


def _shard_bytes(out: pathlib.Path) -> list[bytes]:
    meta = shards.read_meta(out)
    return [(out / s["file"]).read_bytes() for s in meta["shards"]]


def test_every_format_gives_the_jsonl_shards(tmp_path, tok_path):
    paths = _write_formats(tmp_path)
    outs = {}
    for kind, path in paths.items():
        outs[kind] = tmp_path / f"out_{kind.strip('.')}"
        meta = shards.prepare_shards(tok_path, path, outs[kind], shard_tokens=SHARD_TOKENS,
                                     progress=False)
        assert meta["partial_input"] is None
    reference = _shard_bytes(outs[".jsonl"])
    assert len(reference) >= 3
    assert sum(s["n_docs"] for s in shards.read_meta(outs[".jsonl"])["shards"]) == 39
    for kind, out in outs.items():
        assert _shard_bytes(out) == reference, kind


def test_folder_of_mixed_formats_and_text_key(tmp_path, tok_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        _jsonl_bytes(TEXTS[:20])))
    pq.write_table(pa.table({"body": TEXTS[20:]}), folder / "b.parquet")
    assert list_inputs(folder)[1] == ["a.jsonl.zst", "b.parquet"]
    with pytest.raises(DataError, match=r"b.parquet: no 'text' column \(found \['body'\]\); pass "
                                        "--text-key"):
        shards.prepare_shards(tok_path, folder, tmp_path / "bad", progress=False)
    pq.write_table(pa.table({"text": TEXTS[20:]}), folder / "b.parquet")
    shards.prepare_shards(tok_path, folder, tmp_path / "mixed", shard_tokens=SHARD_TOKENS,
                          progress=False)
    (tmp_path / "all.jsonl").write_bytes(_jsonl_bytes(TEXTS))
    shards.prepare_shards(tok_path, tmp_path / "all.jsonl", tmp_path / "ref",
                          shard_tokens=SHARD_TOKENS, progress=False)
    assert _shard_bytes(tmp_path / "mixed") == _shard_bytes(tmp_path / "ref")


def test_parquet_resumes_inside_the_file(tmp_path, tok_path, monkeypatch):
    path = tmp_path / "data.parquet"
    pq.write_table(_table(TEXTS), path, row_group_size=5)
    shards.prepare_shards(tok_path, path, tmp_path / "full", shard_tokens=SHARD_TOKENS,
                          progress=False)
    with killed_at_shard(monkeypatch):
        shards.prepare_shards(tok_path, path, tmp_path / "out", shard_tokens=SHARD_TOKENS,
                              progress=False, batch_chars=1)
    partial = shards.read_meta(tmp_path / "out")["partial_input"]
    assert partial["path"] == "data.parquet" and 0 < partial["records"] < len(TEXTS)
    shards.prepare_shards(tok_path, path, tmp_path / "out", shard_tokens=SHARD_TOKENS,
                          progress=False)
    assert _shard_bytes(tmp_path / "out") == _shard_bytes(tmp_path / "full")


def test_bos_shards_start_every_document(tmp_path, tok_path):
    from titanax.data.tokenizer import Tokenizer

    tok = Tokenizer.load(tok_path)
    (tmp_path / "d.jsonl").write_bytes(_jsonl_bytes(TEXTS))
    meta = shards.prepare_shards(tok_path, tmp_path / "d.jsonl", tmp_path / "out",
                                 shard_tokens=SHARD_TOKENS, progress=False, bos=True)
    assert meta["bos"] is True and meta["bos_id"] == tok.bos_id
    docs = 0
    for arr in shards.open_shards(tmp_path / "out")[1]:
        cuts = np.flatnonzero(arr == tok.eos_id) + 1
        for doc in np.split(np.asarray(arr), cuts)[:-1]:
            assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
            assert (doc[1:] == tok.bos_id).sum() == 0  # only at the start
            docs += 1
    assert docs == 39
    with pytest.raises(DataError, match="bos=True, this run has False"):  # no silent mixing
        shards.prepare_shards(tok_path, tmp_path / "d.jsonl", tmp_path / "out", progress=False)


def test_format_errors_are_clear(tmp_path, tok_path):
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(gzip.compress(_jsonl_bytes(TEXTS))[:-20])
    with pytest.raises(DataError, match="bad.jsonl.gz: cannot decompress"):
        shards.prepare_shards(tok_path, bad, tmp_path / "o1", progress=False)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="junk.parquet: not a readable .parquet file"):
        shards.prepare_shards(tok_path, junk, tmp_path / "o2", progress=False)
    dd = tmp_path / "dd"
    dd.mkdir()
    (dd / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match="a saved DatasetDict with splits"):
        list_inputs(dd)
    no_bos = tmp_path / "nobos.json"
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    hf = HF(models.WordLevel({"a": 0, "<|end_of_text|>": 1}, unk_token="a"))
    hf.save(str(no_bos))
    with pytest.raises(ConfigError, match="--bos: the tokenizer .* has no beginning"):
        shards.prepare_shards(no_bos, tmp_path / "d.jsonl", tmp_path / "o3", bos=True)


def test_binary_input_is_refused_naming_the_file(tmp_path, tok_path, capsys):
    """Random bytes given as text (a .bin, a checkpoint in a --glob '*') are refused in one
    line naming the file and the fix, exit 2, before a token of them is written; a stray
    Latin-1 byte in real text is still read (as U+FFFD)."""
    from launch.prepare_data import main

    rng = np.random.default_rng(0)
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(TEXTS[0] * 50)
    (folder / "b.txt").write_bytes(rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    code = main(["--tokenizer", str(tok_path), "--input", str(folder), "--out",
                 str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert f"{folder / 'b.txt'}: not UTF-8 text (NUL bytes in its first" in err
    assert "leave it out of --input" in err and "convert it to UTF-8 text" in err
    assert not list((tmp_path / "o").glob("*.npy"))[1:]  # at most a.txt's shard
    # no NUL, but mostly not UTF-8 (Latin-1 bytes, high bytes)
    high = rng.integers(128, 256, 5000, dtype=np.uint8).tobytes()
    (folder / "b.txt").write_bytes(high)
    with pytest.raises(DataError, match=r"b.txt: not UTF-8 text \(\d+ invalid UTF-8 "):
        shards.prepare_shards(tok_path, folder / "b.txt", tmp_path / "o2", progress=False)
    # one stray byte in a page of text: read, the byte a U+FFFD
    (folder / "b.txt").write_bytes(TEXTS[1].encode() * 40 + b"caf\xe9 " + b"x" * 200)
    shards.prepare_shards(tok_path, folder / "b.txt", tmp_path / "o3", progress=False)
    assert shards.read_meta(tmp_path / "o3")["complete"]
