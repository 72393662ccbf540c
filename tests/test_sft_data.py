"""Fine-tuning examples: prepare_data --format chat|prompt_response writes a loss mask and
example offsets beside the tokens; rows hold whole examples (first-fit or one per row, long
ones truncated or dropped and counted); targets bear loss only inside an example's mask; the
pipeline refuses what does not match (a text folder for a chat run, a list under --text-key,
padding text) in one line, writing nothing."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from launch.prepare_data import main as prepare_main
from tests.helpers.chat import LLAMA3, special_tokenizer
from titanax.config import Config, ConfigError, DataConfig, ModelConfig, TrainConfig
from titanax.data import shards
from titanax.data.errors import DataError
from titanax.data.example_rows import (
    IGNORE_INDEX,
    ExampleRows,
    ExampleSet,
    first_fit,
    pack_example_rows,
)
from titanax.data.pipeline import build_data
from titanax.data.tokenizer import Tokenizer


def _chat(i: int) -> list[dict]:
    words = " ".join(str((i * 7 + j) % 10) for j in range(2 + i % 5))
    return [{"role": "user", "content": f"reverse {words}"},
            {"role": "assistant", "content": " ".join(reversed(words.split()))}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> pathlib.Path:
    """A byte-level BPE with Llama 3's special tokens and template beside it."""
    folder = tmp_path_factory.mktemp("tok")
    special_tokenizer(folder / "tokenizer.json", "reverse 0 1 2 3 4 5 6 7 8 9 user assistant\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3}))
    return folder


def _prepare(tmp, tok_dir, records, *flags, name="data") -> tuple[int, pathlib.Path]:
    src = tmp / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp / f"{name}_out"
    code = prepare_main(["--tokenizer", str(tok_dir / "tokenizer.json"), "--input", str(src),
                         "--out", str(out), "--no-progress", "--shard-tokens", "200", *flags])
    return code, out


def _spans(tok, ids, mask) -> list[str]:
    """The decoded runs of loss-bearing tokens."""
    runs, run = [], []
    for t, m in zip(ids, mask):
        if m:
            run.append(int(t))
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs + ([tok.decode(run)] if run else [])


def test_chat_examples_carry_a_mask_of_the_replies(tmp_path, tok_dir):
    chats = [{"messages": _chat(i)} for i in range(12)]
    code, out = _prepare(tmp_path, tok_dir, chats, "--format", "chat")
    assert code == 0
    meta = shards.read_meta(out)
    assert meta["data_format"] == "chat" and meta["train_on"] == "assistant"
    assert len(meta["template_sha256"]) == 64 and len(meta["shards"]) > 1  # several shards
    tok = Tokenizer.load(out / "tokenizer.json")
    _, arrays = shards.open_shards(out)
    masks, offsets = shards.open_example_arrays(out, meta)
    examples = ExampleSet.from_shards(arrays, masks, offsets)
    assert len(examples) == 12
    for i in range(12):
        ids, mask = examples.example(i, 10**6)
        reply = chats[i]["messages"][1]["content"]
        assert _spans(tok, ids, mask) == [f"{reply}<|eot_id|>"]
        assert tok.decode(ids).startswith("<|begin_of_text|><|start_header_id|>user")
        assert ids[0] == tok.bos_id  # the template's BOS is one special token
    # --train-on all: the same tokens, every one of them bears loss
    code, out_all = _prepare(tmp_path, tok_dir, chats[:2], "--format", "chat",
                             "--train-on", "all", name="all")
    m_all = shards.open_example_arrays(out_all, shards.read_meta(out_all))[0]
    assert code == 0 and all(m.all() for m in m_all)


def test_prompt_response_with_and_without_a_template(tmp_path, tok_dir):
    pairs = [{"prompt": "reverse 1 2", "response": "2 1"}, {"prompt": "reverse 3 4 5",
                                                           "response": "5 4 3"}]
    code, out = _prepare(tmp_path, tok_dir, pairs, "--format", "prompt_response")
    assert code == 0
    tok = Tokenizer.load(out / "tokenizer.json")
    meta = shards.read_meta(out)
    ex = ExampleSet.from_shards(shards.open_shards(out)[1], *shards.open_example_arrays(out, meta))
    assert [_spans(tok, *ex.example(i, 999)) for i in range(2)] == [["2 1<|eot_id|>"],
                                                                   ["5 4 3<|eot_id|>"]]
    # no template beside the tokenizer: prompt + response + eos, the loss on the last two
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    code, out = _prepare(tmp_path, bare, pairs, "--format", "prompt_response",
                         name="bare")
    meta = shards.read_meta(out)
    assert code == 0 and meta["template_sha256"] is None
    ex = ExampleSet.from_shards(shards.open_shards(out)[1], *shards.open_example_arrays(out, meta))
    ids, mask = ex.example(0, 999)
    assert tok.decode(ids) == "reverse 1 22 1<|end_of_text|>"  # the tokenizer's eos
    assert _spans(tok, ids, mask) == ["2 1<|end_of_text|>"]


def test_refusals_are_one_line_and_write_nothing(tmp_path, tok_dir, capsys):
    # a list of messages under --text-key: names --format
    code, out = _prepare(tmp_path, tok_dir, [{"text": _chat(0)}])
    err = capsys.readouterr().err
    assert code == 2 and "holds a list, not text" in err and "--format chat" in err, err
    assert err.count("\n") == 1 and not out.exists()
    # chat without a template beside the tokenizer
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    code, out = _prepare(tmp_path, bare, [{"messages": _chat(0)}], "--format", "chat")
    err = capsys.readouterr().err
    assert code == 2 and "needs a chat template" in err and not out.exists(), err
    # a conversation without an assistant turn, in a parquet table
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}]]}),
                   tmp_path / "t.parquet")
    code = prepare_main(["--tokenizer", str(tok_dir / "tokenizer.json"), "--input",
                         str(tmp_path / "t.parquet"), "--out", str(out), "--format", "chat",
                         "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "t.parquet:1" in err and "no assistant message" in err, err
    assert not out.exists()


def test_rows_hold_whole_examples():
    # examples of 5, 3 and 12 tokens; the third longer than a row of seq_len + 1 = 8
    tokens = [np.arange(1, 21, dtype=np.uint32)]
    masks = [np.array([0, 0, 1, 1, 1, 0, 1, 1] + [0, 0] + [1] * 10, np.uint8)]
    ex = ExampleSet.from_shards(tokens, masks, [np.array([0, 5, 8, 20])])
    packed = ExampleRows(ex, np.arange(3), 7, packing="pack", truncate="right")
    assert (len(packed), packed.n_truncated) == (2, 1)
    b = pack_example_rows(packed.rows([0, 1]))
    # row 0: examples 0 and 1; no target crosses from one to the other; positions restart
    assert b["segment_ids"][0].tolist() == [1, 1, 1, 1, 1, 2, 2]
    assert b["positions"][0].tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert b["targets"][0].tolist() == [IGNORE_INDEX, 3, 4, 5, IGNORE_INDEX, 7, 8]
    assert b["targets"][1].tolist() == [IGNORE_INDEX, 11, 12, 13, 14, 15, 16]  # cut at 8
    padded = ExampleRows(ex, np.arange(3), 7, packing="pad", truncate="drop")
    assert (len(padded), padded.n_dropped) == (2, 1)
    b = pack_example_rows(padded.rows([1]))
    # one example and then padding: its own segment after the last, never a target
    assert b["segment_ids"][0].tolist() == [1, 1, 1, 2, 2, 2, 2]
    assert b["targets"][0].tolist() == [7, 8] + [IGNORE_INDEX] * 5
    assert "1 longer than 8 tokens dropped" in padded.describe()


def test_first_fit_places_each_item_in_the_first_row_with_room():
    assert first_fit(np.array([5, 3, 4, 2, 6, 1]), 8).tolist() == [0, 0, 1, 1, 2, 1]
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 65, 500)
    bins = first_fit(sizes, 64)
    load = np.bincount(bins, weights=sizes)
    assert load.max() <= 64 and len(load) == bins.max() + 1
    for j in range(0, 500, 37):  # no earlier row had room when item j arrived
        before = np.bincount(bins[:j], weights=sizes[:j], minlength=bins[j] + 1)
        assert all(before[:bins[j]] + sizes[j] > 64)


def _cfg(source, **data) -> Config:
    return Config(model=ModelConfig(vocab_size=320, max_seq_len=64),
                  train=TrainConfig(seq_len=32, batch_size=4, steps=1, eval_batches=1),
                  data=DataConfig(source=str(source), **data))


def test_pipeline_batches_and_refusals(tmp_path, tok_dir):
    chats = [{"messages": _chat(i)} for i in range(40)]
    _, chat_dir = _prepare(tmp_path, tok_dir, chats, "--format", "chat")
    data = build_data(_cfg(chat_dir, val_fraction=0.1), tmp_path / "w")
    batch = next(data.train_iterator())
    assert batch["inputs"].shape == (4, 32) and (batch["targets"] != IGNORE_INDEX).any()
    assert "chat examples" in data.describe() and "36 examples" in data.describe()
    assert len(data.val_batches()) == 1
    none = build_data(_cfg(chat_dir, val_fraction=0.0), tmp_path / "w")
    assert none.val_batches() == [] and "40 examples" in none.describe()
    # the same folder named by its format passes; another format, or text, is refused
    build_data(_cfg(chat_dir, format="chat"), tmp_path / "w")
    with pytest.raises(DataError, match="holds chat examples; set data.format=chat"):
        build_data(_cfg(chat_dir, format="prompt_response"), tmp_path / "w")
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("reverse 1 2 3 " * 200)
    shards.prepare_shards(tok_dir / "tokenizer.json", text, tmp_path / "text_out",
                          progress=False)
    for bad, match in (({"format": "chat"}, "holds text, with no loss masks"),
                       ({"packing": "pad"}, "data.packing=pad puts one example per row")):
        with pytest.raises(DataError, match=match) as e:
            build_data(_cfg(tmp_path / "text_out", **bad), tmp_path / "w")
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="mixes folders of fine-tuning examples"):
        build_data(_cfg(f"{chat_dir}:1,{tmp_path / 'text_out'}:1"), tmp_path / "w")
    with pytest.raises(ConfigError, match="data.truncate"):
        dataclasses.replace(DataConfig(), truncate="left")


# --- small sets (issue 54): the validation split, too few rows, epochs -----------------------


def _small_cfg(source, batch=4, seq_len=32, epochs=0.0, **data) -> Config:
    return Config(model=ModelConfig(vocab_size=320, max_seq_len=max(64, seq_len)),
                  train=TrainConfig(seq_len=seq_len, batch_size=batch, steps=1, epochs=epochs,
                                    eval_batches=2),
                  data=DataConfig(source=str(source), **data))


@pytest.fixture(scope="module")
def chats300(tmp_path_factory, tok_dir) -> pathlib.Path:
    """300 short chats (a few dozen tokens each), as a first fine-tuning set is."""
    tmp = tmp_path_factory.mktemp("chats300")
    code, out = _prepare(tmp, tok_dir, [{"messages": _chat(i)} for i in range(300)],
                         "--format", "chat")
    assert code == 0
    return out


def test_a_small_validation_split_is_evaluated_in_a_smaller_batch(chats300, tmp_path):
    # 2% of 300 chats: 6 examples, 1 or 2 packed rows; at batch 16 they are one smaller batch
    # (filler rows bear no loss), said in one line; before, this was refused
    data = build_data(_small_cfg(chats300, batch=16), tmp_path)
    (val,) = data.val_batches()
    held = len(data.val_windows)
    assert 0 < held < 16 and val["inputs"].shape == (16, 32)
    bears = (val["targets"] != IGNORE_INDEX).any(axis=1)
    assert bears[:held].all() and not bears[held:].any()
    np.testing.assert_array_equal(val["targets"][:held],
                                  pack_example_rows(data.val_windows.rows(range(held)))["targets"])
    notes = [line for line in data.describe().splitlines() if "evaluated as one batch" in line]
    assert len(notes) == 1 and f"holds {held} row(s)" in notes[0], data.describe()
    data.val_batches()
    assert data.describe().count("evaluated as one batch") == 1  # said once


def test_the_validation_split_takes_at_most_a_tenth_and_leaves_a_batch(tmp_path, tok_dir):
    chats = [{"messages": _chat(i)} for i in range(30)]
    _, folder = _prepare(tmp_path, tok_dir, chats, "--format", "chat")
    # val_fraction 0.3 asks 9 of 30: a tenth (3) is held out, and the log says so
    data = build_data(_small_cfg(folder, val_fraction=0.3), tmp_path / "w")
    assert "train 27 examples" in data.describe() and "val 3 examples" in data.describe()
    assert "validation holds 3 of 30 examples, not the 9" in data.describe()
    assert "at most a tenth of the examples" in data.describe()
    # one example a row, batch 28: 27 rows would not fill a batch, so only 2 are held out
    data = build_data(_small_cfg(folder, batch=28, packing="pad", val_fraction=0.1),
                      tmp_path / "w")
    assert len(data.train_windows) == 28 and "val 2 examples" in data.describe()
    assert "not the 3 data.val_fraction=0.1 asks for: at most what leaves training one batch " \
           "of train.batch_size=28 rows" in data.describe()
    # batch 30: none can be held out
    data = build_data(_small_cfg(folder, batch=30, packing="pad"), tmp_path / "w")
    assert data.val_batches() == [] and "no validation" in data.describe()
    # fewer than 10 examples: a tenth is none
    _, five = _prepare(tmp_path, tok_dir, chats[:5], "--format", "chat", name="five")
    data = build_data(_small_cfg(five, batch=1), tmp_path / "w")
    assert data.val_batches() == [] and "validation holds 0 of 5" in data.describe()


def test_too_few_rows_for_a_batch_is_refused_in_one_line(chats300, tmp_path):
    # 300 short chats packed into rows of 2049 tokens are a handful of rows: at batch 16 every
    # step would repeat them (3 epochs were 1 step); refused, with the counts and the fixes
    with pytest.raises(DataError) as e:
        build_data(_small_cfg(chats300, batch=16, seq_len=2048, val_fraction=0.0), tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "holds 300 example(s) in " in msg, msg
    assert "fewer than one batch of train.batch_size=16" in msg
    for fix in ("lower train.batch_size to", "lower train.seq_len (the examples hold",
                "set data.packing=pad (one example a row: 300 rows)"):
        assert fix in msg, msg


def test_epochs_become_steps_over_rows_and_say_so(chats300, tmp_path):
    from titanax.data.pipeline import with_epoch_steps

    cfg = _small_cfg(chats300, batch=16, epochs=3, val_fraction=0.0)
    rows = len(build_data(cfg, tmp_path).train_windows)
    new, line = with_epoch_steps(cfg, tmp_path)
    steps = -(-3 * rows // 16)
    assert new.train.steps == steps > 3
    assert line == (f"train.epochs=3 -> train.steps={steps} (300 examples in {rows} training "
                    f"rows of 33 tokens, train.batch_size=16 rows a step: "
                    f"ceil(3 x {rows} / 16))")
    # the case: rows of 2049 tokens, a handful, gave train.steps=1; now refused
    with pytest.raises(DataError, match="fewer than one batch of train.batch_size=16"):
        with_epoch_steps(_small_cfg(chats300, batch=16, seq_len=2048, epochs=3,
                                    val_fraction=0.0), tmp_path)
