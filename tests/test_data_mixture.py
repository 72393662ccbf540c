"""Weighted mixtures of shard folders (data.source=a:0.7,b:0.3) and BOS per document:
proportions, determinism, exact resume, per-folder validation, and the refusals."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from titanax.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig, load_config
from titanax.data import pipeline, shards
from titanax.data.errors import DataError
from titanax.data.packing import pack
from titanax.data.tokenizer import Tokenizer, train_bpe

# Two folders whose texts share no characters, so every window says which folder it came
# from: 'a' holds letters, 'b' digits. 'a' is the small one, so it cycles several epochs.
A_TEXTS = [" ".join("abcdefgh"[(i + j) % 8] * (1 + j % 3) for j in range(12)) for i in range(30)]
B_TEXTS = [" ".join(str((i * 7 + j) % 10) * (1 + j % 4) for j in range(14)) for i in range(90)]
SEQ = 15


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(A_TEXTS + B_TEXTS, 290, path)
    return path


def _folder(root: pathlib.Path, name: str, texts, tok_path, bos=False) -> pathlib.Path:
    src = root / f"{name}.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    shards.prepare_shards(tok_path, src, root / name, shard_tokens=500, progress=False, bos=bos)
    return root / name


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tok_path):
    root = tmp_path_factory.mktemp("mix")
    return {name: _folder(root, name, texts, tok_path, bos)
            for name, texts, bos in (("a", A_TEXTS, False), ("b", B_TEXTS, False),
                                     ("a_bos", A_TEXTS, True), ("b_bos", B_TEXTS, True))}


def _cfg(source, batch=8, seed=5, bos=False, shuffle=True) -> Config:
    return Config(model=ModelConfig(vocab_size=290, max_seq_len=64),
                  train=TrainConfig(batch_size=batch, seq_len=SEQ, eval_batches=4, seed=seed),
                  data=DataConfig(source=source, val_fraction=0.1, bos=bos, shuffle=shuffle))


def _a_ids(tok_path) -> set[int]:
    tok = Tokenizer.load(tok_path)
    return {i for t in A_TEXTS for i in tok.encode(t)} - {i for t in B_TEXTS
                                                           for i in tok.encode(t)}


def _from_a(batch: dict, a_ids: set[int]) -> np.ndarray:
    return np.array([bool(a_ids & set(row.tolist())) for row in batch["inputs"]])


def test_mixture_proportions_and_exact_resume(folders, tok_path, tmp_path):
    source = f"{folders['a']}:0.7,{folders['b']}:0.3"
    data = pipeline.build_data(_cfg(source), tmp_path)
    assert "mixture of 2 shard folders" in data.describe()
    n_a = len(data.train_windows.parts[0])
    a_ids = _a_ids(tok_path)
    it = data.train_iterator()
    batches = [next(it) for _ in range(125)]  # 1,000 windows
    share = np.concatenate([_from_a(b, a_ids) for b in batches]).mean()
    assert abs(share - 0.7) <= 0.02, share
    assert 700 > 2 * n_a  # 'a' really cycled through several (differently shuffled) epochs

    # Deterministic by seed: a fresh iterator repeats the run, another seed does not.
    again = pipeline.build_data(_cfg(source), tmp_path).train_iterator()
    assert all(_same(b, next(again)) for b in batches[:10])
    other = pipeline.build_data(_cfg(source, seed=6), tmp_path).train_iterator()
    assert not all(_same(b, next(other)) for b in batches[:10])

    # Stop after k batches, restore the state into a fresh iterator: the same next batches.
    it2 = pipeline.build_data(_cfg(source), tmp_path).train_iterator()
    for _ in range(37):
        next(it2)
    state = it2.get_state()
    resumed = pipeline.build_data(_cfg(source), tmp_path).train_iterator()
    resumed.set_state(json.loads(json.dumps(state)))  # as the checkpoint stores it (JSON)
    assert all(_same(batches[37 + k], next(resumed)) for k in range(12))


def test_mixture_validation_is_per_folder(folders, tok_path, tmp_path):
    source = [(str(folders["a"]), 1), (str(folders["b"]), 1)]  # the Python config's list form
    cfg = _cfg(source, shuffle=False)
    assert cfg.data.source == f"{folders['a']}:1.0,{folders['b']}:1.0"
    data = pipeline.build_data(cfg, tmp_path)
    a_ids = _a_ids(tok_path)
    val = np.concatenate([_from_a(b, a_ids) for b in data.val_batches()])
    assert 0.4 <= val.mean() <= 0.6  # both folders' held-out tails, half each
    # Held out means held out: no validation window is a training window of its folder.
    train_rows = {tuple(r) for p in data.train_windows.parts for r in p.rows(range(len(p)))}
    val_rows = {tuple(r) for r in data.val_windows.rows(range(len(data.val_windows)))}
    assert val_rows and not train_rows & val_rows


def test_mixture_refuses_disagreeing_folders(folders, tmp_path, tok_path):
    mixed = f"{folders['a_bos']}:0.5,{folders['b']}:0.5"
    with pytest.raises(DataError, match=r"disagree on BOS per document \(with: \[.*a_bos'\], "
                                        r"without: \[.*b'\]\)"):
        pipeline.build_data(_cfg(mixed, bos=True), tmp_path)
    with pytest.raises(DataError, match=r"data.bos=true: .*a was written without BOS per "
                                        r"document .*set data.bos=false, or re-run `python -m "
                                        r"launch.prepare_data --bos`"):
        pipeline.build_data(_cfg(str(folders["a"]), bos=True), tmp_path)
    with pytest.raises(DataError, match=r"data.bos=false: every folder of data.source \(.*a_bos, .*b_bos\) was written "
                                        "with BOS"):
        pipeline.build_data(_cfg(f"{folders['a_bos']}:1,{folders['b_bos']}:2"), tmp_path)
    other_tok = tmp_path / "other.json"
    train_bpe(B_TEXTS, 280, other_tok)
    c = _folder(tmp_path, "c", B_TEXTS, other_tok)
    with pytest.raises(DataError, match="different tokenizers"):
        pipeline.build_data(_cfg(f"{folders['a']}:1,{c}:1"), tmp_path)
    # One folder against the run's own tokenizer (an imported model's data.tokenizer): its
    # ids would mean other words. The same vocabulary in other bytes passes.
    named = lambda src, tok: Config(**{**_cfg(src).__dict__, "data": DataConfig(  # noqa: E731
        source=src, val_fraction=0.1, tokenizer=str(tok))})
    with pytest.raises(DataError, match=r"data.tokenizer: .*c was tokenized with another "
                                        r"tokenizer than data.tokenizer=.*tokenizer.json .*"
                                        r"re-run `python -m launch.prepare_data --tokenizer"):
        pipeline.build_data(named(str(c), tok_path), tmp_path)
    with pytest.raises(DataError, match=r"c was tokenized with another tokenizer"):
        pipeline.build_data(named(f"{folders['a']}:1,{c}:1", tok_path), tmp_path)
    reformatted = tmp_path / "same.json"
    reformatted.write_text(json.dumps(json.loads(tok_path.read_text()), indent=4))
    pipeline.build_data(named(str(folders["a"]), reformatted), tmp_path)


def test_bos_folders_pack_each_document_from_bos(folders, tok_path, tmp_path):
    tok = Tokenizer.load(tok_path)
    data = pipeline.build_data(_cfg(f"{folders['a_bos']}:0.5,{folders['b_bos']}:0.5",
                                    bos=True), tmp_path)
    b = next(data.train_iterator())
    inputs, seg, pos = b["inputs"], b["segment_ids"], b["positions"]
    after_eos = np.zeros_like(inputs, bool)
    after_eos[:, 1:] = inputs[:, :-1] == tok.eos_id
    assert after_eos.any()
    # Every document start inside a window is a BOS at position 0 of a new segment.
    assert (inputs[after_eos] == tok.bos_id).all() and (pos[after_eos] == 0).all()
    assert (seg[:, 1:][after_eos[:, 1:]] == seg[:, :-1][after_eos[:, 1:]] + 1).all()


def test_embedded_tokenize_with_bos(tok_path):
    tok = Tokenizer.load(tok_path)
    stream = pipeline._tokenize(["ab cd", "12 3"], tok, tok.bos_id)
    expect = ([tok.bos_id] + tok.encode("ab cd") + [tok.eos_id]
              + [tok.bos_id] + tok.encode("12 3") + [tok.eos_id])
    assert stream.tolist() == expect
    p = pack(stream[None, :], tok.eos_id)
    second = len(tok.encode("ab cd")) + 2
    assert p["positions"][0, second] == 0 and p["inputs"][0, second] == tok.bos_id


def test_bos_without_a_bos_token_is_a_clear_error(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models

    path = tmp_path / "nobos.json"
    HF(models.WordLevel({"a": 0, "<|end_of_text|>": 1}, unk_token="a")).save(str(path))
    with pytest.raises(ConfigError, match="data.bos=true: the tokenizer .*nobos.json has no "
                                          "beginning-of-document token"):
        Tokenizer.load(path).require_bos()


def test_source_forms(tmp_path):
    gin = tmp_path / "mix.gin"
    gin.write_text("data.source = 'web:0.7,code:0.3'\n")
    assert load_config(gin).data.folders() == [("web", 0.7), ("code", 0.3)]
    cfg = load_config(None, ["data.source=web:7,code:3", "data.bos=true"])
    assert cfg.data.folders() == [("web", 7.0), ("code", 3.0)] and cfg.data.bos
    assert DataConfig(source="/data/my,shards").folders() == [("/data/my,shards", 1.0)]
    assert DataConfig(source={"web": 2, "code": 1}).source == "web:2.0,code:1.0"
    assert Config.from_dict(_cfg([("x", 0.5), ("y", 0.5)]).to_dict()).data.source == \
        "x:0.5,y:0.5"
    for bad, msg in (("a:0.7,b", "'b' is not folder:weight"), ("a:-1,b:1", "weight > 0"),
                     ("a:1,a:2", "appears twice"), ("synthetic:1,a:1", "not 'synthetic'")):
        with pytest.raises(ConfigError, match=msg):
            DataConfig(source=bad)
    with pytest.raises(ConfigError, match="is not a .folder, weight. pair"):
        DataConfig(source=[("a", "0.5")])


def _same(a: dict, b: dict) -> bool:
    return all(np.array_equal(a[k], b[k]) for k in a)
