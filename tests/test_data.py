"""Data pipeline: packing, shard format and resume, validation errors, grain state, splits."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from tests.helpers.interrupt import killed_at_shard
from titanax.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from titanax.data import corpus, pipeline, shards
from titanax.data.packing import StreamWindows, TokenStream, pack
from titanax.data.shards import DataError
from titanax.data.tokenizer import Tokenizer, load_or_train, train_bpe

KEYS = ("inputs", "targets", "segment_ids", "positions")


def _cfg(source: str, vocab=512, batch=4, seq_len=16, eval_batches=2, val_fraction=0.1,
         **data) -> Config:
    return Config(model=ModelConfig(vocab_size=vocab, max_seq_len=max(seq_len, 64)),
                  train=TrainConfig(batch_size=batch, seq_len=seq_len,
                                    eval_batches=eval_batches, seed=3),
                  data=DataConfig(source=source, val_fraction=val_fraction, **data))


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in KEYS)


# --- packing -----------------------------------------------------------------------------------

def test_pack_segments_and_positions():
    eos = 0
    # Window of 9 tokens: doc A (tail) 5 6 eos | doc B 7 eos | doc C 8 9 10 eos...
    w = np.array([[5, 6, 0, 7, 0, 8, 9, 10, 0]])
    b = pack(w, eos, document_masking=True)
    np.testing.assert_array_equal(b["inputs"], [[5, 6, 0, 7, 0, 8, 9, 10]])
    np.testing.assert_array_equal(b["targets"], [[6, 0, 7, 0, 8, 9, 10, 0]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2, 2, 3, 3, 3]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0, 1, 0, 1, 2]])
    # eos as the first input: the window starts a fresh document right after it.
    b = pack(np.array([[0, 4, 4, 0, 0, 3]]), eos)
    np.testing.assert_array_equal(b["segment_ids"], [[1, 2, 2, 2, 3]])
    np.testing.assert_array_equal(b["positions"], [[0, 0, 1, 2, 0]])
    assert all(v.dtype == np.int32 for v in b.values())


def test_pack_masking_off_and_no_eos():
    w = np.array([[5, 0, 7, 0, 8], [1, 2, 3, 4, 5]])
    for b in (pack(w, 0, document_masking=False), pack(w, None)):
        np.testing.assert_array_equal(b["segment_ids"], np.ones((2, 4)))
        np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3]] * 2)


def test_token_stream_reads_across_parts():
    parts = [np.arange(0, 5), np.arange(5, 7), np.arange(7, 20)]
    s = TokenStream(parts)
    assert len(s) == 20
    np.testing.assert_array_equal(s.read(3, 10), np.arange(3, 13))
    v = s.view(4, 18)
    np.testing.assert_array_equal(v.to_array(), np.arange(4, 18))
    w = StreamWindows(v, seq_len=4)  # windows of 5: [4..8], [9..13]
    assert len(w) == 2
    np.testing.assert_array_equal(w.rows([1, 0]), [np.arange(9, 14), np.arange(4, 9)])


# --- shards: writing, reading, resume ----------------------------------------------------------

TEXTS = [f"def f{i}(x):\n    return x * {i} + {'y' * (i % 7)}\n" * (1 + i % 3) for i in range(60)]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(TEXTS * 3, 300, path)
    return path


def _make_inputs(root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path, list[str]]:
    folder = root / "folder"
    (folder / "sub").mkdir(parents=True)
    expected = []
    for i, text in enumerate(TEXTS[:20]):
        name = f"doc{i:02d}.txt" if i % 2 else f"sub/doc{i:02d}.md"
        (folder / name).write_text(text)
    # Sorted relative-path order: doc01.txt, doc03.txt, ..., sub/doc00.md, ...
    expected = [TEXTS[i] for i in range(1, 20, 2)] + [TEXTS[i] for i in range(0, 20, 2)]
    (folder / "ignored.bin").write_bytes(b"\x00\x01")
    jsonl = root / "data.jsonl"
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(TEXTS)]
    lines.insert(5, "")  # blank lines are skipped
    jsonl.write_text("\n".join(lines) + "\n")
    return folder, jsonl, expected


def _docs_of(folder: pathlib.Path, tok: Tokenizer) -> list[str]:
    meta, arrays = shards.open_shards(folder, vocab_size=tok.vocab_size)
    stream = np.concatenate(arrays)
    cuts = np.flatnonzero(stream == meta["eos_id"])
    return [tok.decode(d[:-1]) for d in np.split(stream, cuts + 1)[:-1]]


def test_shard_round_trip_folder_and_jsonl(tmp_path, tok_path):
    folder, jsonl, expected = _make_inputs(tmp_path)
    tok = Tokenizer.load(tok_path)
    meta = shards.prepare_shards(tok_path, folder, tmp_path / "out1", shard_tokens=200,
                                 progress=False)
    assert len(meta["shards"]) > 1 and meta["partial_input"] is None
    assert len(meta["done_inputs"]) == 20
    assert _docs_of(tmp_path / "out1", tok) == expected
    assert (tmp_path / "out1" / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    for entry in meta["shards"]:
        arr = np.load(tmp_path / "out1" / entry["file"], allow_pickle=False)
        assert arr.dtype == np.uint32 and arr.ndim == 1 and arr.size == entry["n_tokens"]

    meta = shards.prepare_shards(tok_path, jsonl, tmp_path / "out2", shard_tokens=300,
                                 progress=False)
    assert _docs_of(tmp_path / "out2", tok) == TEXTS
    assert sum(s["n_docs"] for s in meta["shards"]) == len(TEXTS)


@pytest.mark.parametrize("kind", ["folder", "jsonl"])
def test_prepare_resumes_after_interruption(tmp_path, tok_path, monkeypatch, kind):
    folder, jsonl, _ = _make_inputs(tmp_path)
    src = folder if kind == "folder" else jsonl
    full = shards.prepare_shards(tok_path, src, tmp_path / "full", shard_tokens=150,
                                 progress=False)
    assert len(full["shards"]) >= 4

    out = tmp_path / "resumed"
    with killed_at_shard(monkeypatch):  # while writing the third shard: a partial temp file
        shards.prepare_shards(tok_path, src, out, shard_tokens=150, progress=False)
    assert len(shards.read_meta(out)["shards"]) == 2
    # Unfinished: training takes it only when told to (its validation tail will move).
    assert shards.read_meta(out)["complete"] is False
    with pytest.raises(DataError, match=r"is unfinished: its prepare_data was interrupted .*"
                                        r"set data.allow_partial=true"):
        pipeline.build_data(_cfg(str(out), vocab=300), tmp_path / "wd")
    pipeline.build_data(_cfg(str(out), vocab=300, allow_partial=True), tmp_path / "wd")

    # The rerun must not re-tokenize documents already in the two finished shards.
    encoded = []
    real_encode = Tokenizer.encode_batch
    monkeypatch.setattr(Tokenizer, "encode_batch",
                        lambda self, texts: encoded.extend(texts) or real_encode(self, texts))
    meta = shards.prepare_shards(tok_path, src, out, shard_tokens=150, progress=False)
    done_docs = sum(s["n_docs"] for s in full["shards"][:2])
    all_docs = sum(s["n_docs"] for s in full["shards"])
    assert len(encoded) == all_docs - done_docs
    assert meta["shards"] == full["shards"]
    for entry in meta["shards"]:
        assert (out / entry["file"]).read_bytes() == (tmp_path / "full" / entry["file"]).read_bytes()
    assert not list(out.glob(".*tmp*"))
    # A finished folder re-run is a no-op.
    meta2 = shards.prepare_shards(tok_path, src, out, shard_tokens=150, progress=False)
    assert meta2["shards"] == meta["shards"] and meta2["complete"] is True
    pipeline.build_data(_cfg(str(out), vocab=300), tmp_path / "wd")


def test_prepare_rejects_other_tokenizer_on_resume(tmp_path, tok_path):
    folder, _, _ = _make_inputs(tmp_path)
    shards.prepare_shards(tok_path, folder, tmp_path / "out", progress=False)
    other = tmp_path / "other.json"
    train_bpe(TEXTS, 280, other)
    with pytest.raises(DataError, match="tokenizer_sha256"):
        shards.prepare_shards(other, folder, tmp_path / "out", progress=False)


def test_launch_prepare_data_cli(tmp_path, tok_path, capsys):
    from launch.prepare_data import main

    _, jsonl, _ = _make_inputs(tmp_path)
    assert main(["--tokenizer", str(tok_path), "--input", str(jsonl), "--out",
                 str(tmp_path / "o"), "--shard-tokens", "500", "--no-progress"]) == 0
    assert "60 documents" in capsys.readouterr().out
    assert main(["--tokenizer", str(tok_path), "--input", str(tmp_path / "nope"), "--out",
                 str(tmp_path / "o2")]) == 2
    # A wrong --text-key fails before any shard; the corrected command then runs in the same
    # --out (its first run's settings were never used).
    assert main(["--tokenizer", str(tok_path), "--input", str(jsonl), "--out",
                 str(tmp_path / "o3"), "--text-key", "body", "--no-progress"]) == 2
    assert "body" in capsys.readouterr().err
    assert main(["--tokenizer", str(tok_path), "--input", str(jsonl), "--out",
                 str(tmp_path / "o3"), "--no-progress"]) == 0
    assert "60 documents" in capsys.readouterr().out


def _write_folder(folder: pathlib.Path, arrays: list, vocab=100) -> None:
    folder.mkdir()
    entries = []
    for i, arr in enumerate(arrays):
        if isinstance(arr, bytes):
            (folder / shards.shard_name(i)).write_bytes(arr)
            entries.append({"file": shards.shard_name(i), "n_docs": 1})
            continue
        np.save(folder / shards.shard_name(i), arr, allow_pickle=True)
        entries.append({"file": shards.shard_name(i), "n_tokens": int(np.size(arr)), "n_docs": 1})
    shards.write_json_atomic(folder / shards.META, {
        "format": shards.FORMAT, "version": shards.VERSION, "vocab_size": vocab, "eos_id": 0,
        "bos_id": None, "shards": entries, "done_inputs": [], "partial_input": None})


def test_shard_validation_errors(tmp_path):
    ok = np.arange(50, dtype=np.uint32)
    cases = {
        "big_id": ([ok, np.array([1, 2, 120, 3], np.uint32)], r"max id 120.*model.vocab_size=100"),
        "empty": ([ok, np.zeros(0, np.uint32)], "empty shard"),
        "corrupt": ([ok, b"\x93NUMPY garbage"], "corrupt"),
        "float": ([np.ones(8, np.float32)], "not an integer"),
        "pickle": ([np.array([{"a": 1}], dtype=object)], "corrupt"),
    }
    for name, (arrays, pattern) in cases.items():
        _write_folder(tmp_path / name, arrays)
        with pytest.raises(DataError, match=pattern) as e:
            shards.open_shards(tmp_path / name, vocab_size=100)
        assert shards.shard_name(len(arrays) - 1) in str(e.value)
    (tmp_path / "nometa").mkdir()
    with pytest.raises(DataError, match="meta.json: missing"):
        pipeline.build_data(_cfg(str(tmp_path / "nometa"), vocab=100), tmp_path / "wd")
    with pytest.raises(ConfigError, match="neither"):
        pipeline.build_data(_cfg(str(tmp_path / "nowhere")), tmp_path / "wd")


def test_token_out_of_range_behind_a_stale_max_id_names_the_file(tmp_path):
    """meta.json says every id is below the vocabulary, but a flipped bit says otherwise: the
    batch that reads it stops the run, naming the shard and the token."""
    arrays = [np.arange(60, dtype=np.uint32) % 50, np.arange(60, dtype=np.uint32) % 50]
    _write_folder(tmp_path / "d", arrays)
    shards.open_shards(tmp_path / "d", vocab_size=100)  # records max_id 49 for both
    bad = np.load(tmp_path / "d" / shards.shard_name(1))
    bad[17] = 4000  # not recorded: the start-up check passes on the stale max_id
    np.save(tmp_path / "d" / shards.shard_name(1), bad)
    data = pipeline.build_data(_cfg(str(tmp_path / "d"), vocab=100), tmp_path / "wd")
    with pytest.raises(DataError, match=rf"{shards.shard_name(1)}: token id 4000 at token 17 is "
                                        r"outside \[0, model.vocab_size=100\)"):
        it = data.train_iterator()
        for _ in range(40):
            next(it)


# --- pipeline: grain state, process slicing, splits -------------------------------------------

@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, tok_path) -> pathlib.Path:
    root = tmp_path_factory.mktemp("shards")
    _, jsonl, _ = _make_inputs(root)
    shards.prepare_shards(tok_path, jsonl, root / "out", shard_tokens=400, progress=False)
    return root / "out"


def test_iterator_state_resume_is_exact(shard_dir, tmp_path):
    data = pipeline.build_data(_cfg(str(shard_dir), vocab=300), tmp_path)
    assert data.tokenizer is not None and "shards" in data.describe()
    n_windows = len(data.train_windows)
    it = data.train_iterator()
    steps = n_windows // 4 + 3  # run into the second epoch
    for _ in range(steps):
        next(it)
    state = it.get_state()
    expected = [next(it) for _ in range(6)]
    it2 = pipeline.build_data(_cfg(str(shard_dir), vocab=300), tmp_path).train_iterator()
    it2.set_state(state)
    assert all(_same(a, next(it2)) for a in expected)
    # Epochs are shuffled differently, and each covers every window once.
    it3 = data.train_iterator()
    per_epoch = n_windows // 4
    e1 = np.concatenate([next(it3)["inputs"] for _ in range(per_epoch)])
    first_windows = {tuple(r) for r in e1}
    assert len(first_windows) == per_epoch * 4
    e2 = np.concatenate([next(it3)["inputs"] for _ in range(per_epoch)])
    assert not np.array_equal(e1, e2)


def test_process_slices_concatenate_to_global_batch(shard_dir, tmp_path):
    cfg = _cfg(str(shard_dir), vocab=300)
    whole = pipeline.build_data(cfg, tmp_path)
    parts = [pipeline.build_data(cfg, tmp_path, process_index=i, process_count=2)
             for i in range(2)]
    iters = [p.train_iterator() for p in parts]
    it = whole.train_iterator()
    for _ in range(3):
        b = next(it)
        pb = [next(i) for i in iters]
        assert pb[0]["inputs"].shape == (2, 16)
        for k in KEYS:
            np.testing.assert_array_equal(np.concatenate([p[k] for p in pb]), b[k])
    v = whole.val_batches()
    pv = [p.val_batches() for p in parts]
    for j, b in enumerate(v):
        np.testing.assert_array_equal(np.concatenate([p[j]["inputs"] for p in pv]), b["inputs"])
    with pytest.raises(ConfigError, match="divisible"):
        pipeline.build_data(cfg, tmp_path, process_count=3)


def test_val_split_smaller_than_a_batch(shard_dir, tmp_path):
    """A split of fewer windows than a batch is evaluated as one batch of those windows, the
    rest filler that bears no loss (said in one line); a split without one window is refused."""
    data = pipeline.build_data(_cfg(str(shard_dir), vocab=300, batch=64, val_fraction=0.01),
                               tmp_path)
    held = len(data.val_windows)
    assert 0 < held < 64
    (val,) = data.val_batches()
    assert val["inputs"].shape == (64, 16)
    want = pack(data.val_windows.rows(range(held)), data.eos_id)
    for k in KEYS:
        np.testing.assert_array_equal(val[k][:held], want[k])
    assert (val["targets"][held:] == -100).all()
    assert f"holds {held} row(s) of 17 tokens, fewer than train.batch_size=64: it is " \
           f"evaluated as one batch of those {held}" in data.describe()
    parts = [pipeline.build_data(_cfg(str(shard_dir), vocab=300, batch=64, val_fraction=0.01),
                                 tmp_path, process_index=i, process_count=2).val_batches()[0]
             for i in range(2)]
    for k in KEYS:  # each process its rows of the same global batch
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), val[k])
    _write_folder(tmp_path / "small", [np.arange(200, dtype=np.uint32) % 50])  # val: 4 tokens
    small = pipeline.build_data(_cfg(str(tmp_path / "small"), vocab=100, val_fraction=0.02),
                                tmp_path)
    with pytest.raises(DataError, match="holds no window of train.seq_len"):
        small.val_batches()


def test_embedded_split_and_cache(tmp_path, monkeypatch):
    cfg = _cfg("embedded", vocab=512, seq_len=64, embedded_max_bytes=300_000)
    data = pipeline.build_data(cfg, tmp_path)
    tok = data.tokenizer
    assert tok.vocab_size <= 512 and (tmp_path / "tokenizer.json").is_file()
    docs = corpus.load_documents(300_000)
    n_val = max(1, round(len(docs) * cfg.data.val_fraction))
    train_docs, val_docs = pipeline.split_documents(docs, cfg.data.val_fraction)
    # Held out: every k-th document, spread over the whole corpus; together the splits are
    # exactly the corpus.
    stride = len(docs) // n_val
    assert val_docs == [docs[i] for i in range(stride - 1, len(docs), stride)][:n_val]
    assert sorted(train_docs + val_docs) == sorted(docs)
    train = data.train_windows.stream.to_array()
    val = data.val_windows.stream.to_array()
    # Each split is exactly its own documents, each followed by eos: nothing shared.
    def stream_of(ds):
        return np.concatenate([np.array(tok.encode(d) + [tok.eos_id]) for d in ds])
    np.testing.assert_array_equal(val, stream_of(val_docs))
    np.testing.assert_array_equal(train, stream_of(train_docs))
    assert not set(val_docs) & set(train_docs)
    assert len(data.val_batches()) >= 1
    b = next(data.train_iterator())
    assert b["inputs"].shape == (4, 64) and b["inputs"].max() < 512
    assert len(list(tmp_path.glob("embedded_tokens_*.npy"))) == 2

    # Second run: tokenizer and token streams come from the cache, nothing is retrained.
    from titanax.data import tokenizer as tokenizer_mod

    monkeypatch.setattr(tokenizer_mod, "train_bpe", lambda *a: pytest.fail("retrained"))
    monkeypatch.setattr(pipeline, "_tokenize", lambda *a: pytest.fail("re-tokenized"))
    again = pipeline.build_data(cfg, tmp_path)
    assert _same(next(again.train_iterator()), b)
    assert again.describe() == data.describe()


def test_tokenizer_vocab_larger_than_model(tok_path, tmp_path):
    cfg = _cfg("embedded", vocab=100, tokenizer=str(tok_path))
    with pytest.raises(ConfigError, match=r"300 tokens but model.vocab_size=100"):
        load_or_train(cfg.data, cfg.model, tmp_path)
    cfg = _cfg("embedded", tokenizer=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_or_train(cfg.data, cfg.model, tmp_path)


def test_synthetic_is_deterministic(tmp_path):
    cfg = _cfg("synthetic", vocab=1000, seq_len=32)
    a, b = (pipeline.build_data(cfg, tmp_path) for _ in range(2))
    assert a.tokenizer is None and "synthetic" in a.describe()
    ia, ib = a.train_iterator(), b.train_iterator()
    batches = [next(ia) for _ in range(3)]
    assert all(_same(x, next(ib)) for x in batches)
    assert not np.array_equal(batches[0]["inputs"], batches[1]["inputs"])
    x = batches[0]
    assert x["inputs"].max() < 1000 and (x["segment_ids"] == 1).all()
    np.testing.assert_array_equal(x["positions"], np.tile(np.arange(32), (4, 1)))
    val = a.val_batches()
    assert len(val) == 2 and _same(val[0], b.val_batches()[0])
    assert not np.array_equal(val[0]["inputs"], x["inputs"])
    other_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=4))
    other = pipeline.build_data(other_cfg, tmp_path)
    assert not np.array_equal(next(other.train_iterator())["inputs"], x["inputs"])


def test_sampling_and_export_take_the_tokenizer_the_config_names(tmp_path):
    """A tokenizer.json lying in the workdir (a stray one, trained by a run of another config)
    never overrides the tokenizer the run's config names: an imported run's, or its shard
    folder's. The embedded corpus's own is the workdir's."""
    from titanax.generate import find_tokenizer

    work, imported, shards_dir = tmp_path / "run", tmp_path / "hf", tmp_path / "shards"
    for folder in (work, imported, shards_dir):
        folder.mkdir()
        (folder / "tokenizer.json").write_text("{}")
    named = Config(data=DataConfig(source="embedded", tokenizer=str(imported / "tokenizer.json")))
    assert find_tokenizer(named, work) == imported / "tokenizer.json"
    folder_cfg = Config(data=DataConfig(source=str(shards_dir)))
    assert find_tokenizer(folder_cfg, work) == shards_dir / "tokenizer.json"
    assert find_tokenizer(Config(data=DataConfig(source="embedded")), work) == \
        work / "tokenizer.json"
    assert find_tokenizer(Config(data=DataConfig(source="synthetic")), tmp_path) is None
