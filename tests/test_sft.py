"""Fine-tuning end to end against transformers: a random Llama with a Llama-3-style chat
template is made and scored in transformers (tests/hf_peer/sft_peer.py), imported, its chats
prepared with `prepare_data --format chat`, and one titanax step's loss equals transformers'
loss with labels=-100 outside the assistant tokens: one example per row, with grad_accum 4,
packed, and on an fsdp 2 x tensor 2 mesh. Then a short fine-tune teaches the imported model
an instruction it could not follow, answered through `launch.generate --chat`."""

from __future__ import annotations

import json
import pathlib
import shutil
import types

import jax
import numpy as np
import pytest
from torch_peer import run_jobs

from launch.prepare_data import main as prepare_main
from tests.helpers.chat import SPECIALS, special_tokenizer
from titanax.config import load_config
from titanax.data import shards
from titanax.data.example_rows import ExampleRows, ExampleSet
from titanax.hf.importer import import_hf
from titanax.hf.run_config import import_config
from titanax.train import loop

pytestmark = pytest.mark.usefixtures("devices8")

# Llama 3's chat format, the assistant's text and end of turn in a {% generation %} block so
# that transformers finds the assistant tokens on its own (return_assistant_tokens_mask).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
            "<|end_header_id|>\n\n{% if m['role'] == 'assistant' %}{% generation %}"
            "{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}{% else %}"
            "{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}")


def reverse_chat(i: int, n_turns: int = 1) -> list[dict]:
    """'reverse a b c' -> 'c b a' over digits, with a system message on some."""
    rng = np.random.default_rng(i)
    chat = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
    for _ in range(n_turns):
        words = [str(d) for d in rng.integers(0, 10, rng.integers(2, 5))]
        chat += [{"role": "user", "content": "reverse " + " ".join(words)},
                 {"role": "assistant", "content": " ".join(reversed(words))}]
    return chat


CHATS = [reverse_chat(i, 1 + i % 2) for i in range(16)]  # 16 examples, some of two turns


def _tokenizer(folder: pathlib.Path) -> pathlib.Path:
    return special_tokenizer(folder / "tokenizer.json", "reverse 0 1 2 3 4 5 6 7 8 9 system "
                             "user assistant Answer briefly.\n")


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """transformers' model, tokenizer and loss; the model imported; the chats prepared."""
    from tokenizers import Tokenizer as HFTokenizer

    tmp = tmp_path_factory.mktemp("sft")
    tok_path = _tokenizer(tmp)
    vocab = HFTokenizer.from_file(str(tok_path)).get_vocab_size(with_added_tokens=True)
    # rows for every id the tokenizer has, rounded up as real vocabularies are (tensor 2)
    config = {"vocab_size": -(-vocab // 8) * 8, "hidden_size": 64, "intermediate_size": 160,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "initializer_range": 0.1,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    ids = HFTokenizer.from_file(str(tok_path)).token_to_id
    # an Instruct model's config: BOS, and the end of turn as its eos (generation stops there)
    config.update(bos_token_id=ids(SPECIALS[0]), eos_token_id=ids("<|eot_id|>"))
    run_jobs("sft_peer.py", [
        {"op": "make", "dir": str(tmp / "hf"), "config": config, "seed": 0,
         "tokenizer": str(tok_path), "template": TEMPLATE, "bos": SPECIALS[0],
         "eos": "<|eot_id|>"},
        {"op": "loss", "dir": str(tmp / "hf"), "chats": CHATS, "out": str(tmp / "hf.json")}],
        tmp)
    imported = tmp / "imported"
    cfg = import_config(tmp / "hf")
    import_hf(tmp / "hf", cfg, imported, progress=False, log=lambda *_: None)
    (tmp / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    assert prepare_main(["--tokenizer", str(imported / "hf_tokenizer" / "tokenizer.json"),
                         "--input", str(tmp / "chats.jsonl"), "--out", str(tmp / "data"),
                         "--format", "chat", "--no-progress"]) == 0
    return types.SimpleNamespace(tmp=tmp, imported=imported, cfg=cfg, data=tmp / "data",
                                 hf=json.loads((tmp / "hf.json").read_text()))


def test_the_import_recipe_asks_for_examples(sft):
    # an Instruct model (a chat template) is fine-tuned on examples, in its config.json's dtype
    assert sft.cfg.data.format == "examples" and sft.cfg.execution.dtype == "float32"
    assert sft.cfg.train.seq_len == 128


def test_masks_are_transformers_assistant_tokens(sft):
    meta = shards.read_meta(sft.data)
    examples = ExampleSet.from_shards(shards.open_shards(sft.data)[1],
                                      *shards.open_example_arrays(sft.data, meta))
    for i in range(len(CHATS)):
        ids, mask = examples.example(i, 10**6)
        assert ids.tolist() == sft.hf["ids"][i], i
        assert mask.tolist() == sft.hf["masks"][i], i


def _step_loss(sft, name: str, n_devices: int, **sets) -> float:
    """The loss of one titanax step on the prepared chats, from a copy of the import."""
    workdir = sft.tmp / name
    shutil.copytree(sft.imported, workdir)
    cfg = load_config(workdir / "config.json", {
        "data.source": str(sft.data), "data.val_fraction": 0, "train.steps": 1,
        "train.log_every": 1, "train.progress_bar": False, "checkpoint.every_steps": 0,
        **sets})
    result = loop.train(cfg, workdir, log=lambda *_: None, devices=jax.devices()[:n_devices])
    return result.losses[1]


@pytest.mark.parametrize("name,n_devices,sets", [
    ("pad", 8, {"data.packing": "pad", "train.batch_size": 16}),
    ("accum4", 4, {"data.packing": "pad", "train.batch_size": 16, "train.grad_accum": 4}),
    ("fsdp2_tp2", 4, {"data.packing": "pad", "train.batch_size": 16, "mesh.fsdp": 2,
                      "mesh.tensor": 2}),
])
def test_one_step_loss_is_transformers_loss(sft, name, n_devices, sets):
    loss = _step_loss(sft, name, n_devices, **sets)
    np.testing.assert_allclose(loss, sft.hf["loss"], rtol=1e-5)


def test_packed_rows_give_the_same_loss(sft):
    # as many rows as first-fit packs the 16 chats into: one step sees each chat once
    meta = shards.read_meta(sft.data)
    examples = ExampleSet.from_shards(shards.open_shards(sft.data)[1],
                                      *shards.open_example_arrays(sft.data, meta))
    rows = ExampleRows(examples, np.arange(len(CHATS)), sft.cfg.train.seq_len, seed=0)
    assert len(rows) < len(CHATS) // 2  # several chats per row
    loss = _step_loss(sft, "packed", 1, **{"data.packing": "pack",
                                           "train.batch_size": len(rows)})
    np.testing.assert_allclose(loss, sft.hf["loss"], rtol=1e-5)


def test_refusals_are_one_line_and_change_nothing(sft, tmp_path, capsys):
    from launch.train import main as train_main

    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("reverse 1 2 3\n" * 100)
    assert prepare_main(["--tokenizer", str(sft.imported / "hf_tokenizer" / "tokenizer.json"),
                         "--input", str(text), "--out", str(tmp_path / "shards"),
                         "--no-progress"]) == 0
    capsys.readouterr()
    before = {p: p.stat().st_mtime_ns for p in sft.imported.rglob("*")}
    for sets, says in ((["--set", f"data.source={tmp_path / 'shards'}"],
                        "data.format=examples: data.source="),
                       ([], "data.source is not set")):
        with pytest.raises(SystemExit) as e:
            train_main(["--workdir", str(sft.imported), *sets])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and says in err, err
        assert err.count("\n") == 1, err
    assert {p: p.stat().st_mtime_ns for p in sft.imported.rglob("*")} == before


def _reply(capsys, workdir: pathlib.Path, prompt: str) -> str:
    """launch.generate --chat's greedy answer, in this process."""
    from launch.generate import main

    main(["--workdir", str(workdir), "--prompt", prompt, "--chat", "--max-new-tokens", "12"])
    return capsys.readouterr().out.strip()


def test_a_short_fine_tune_follows_the_instruction(sft, capsys):
    train = [reverse_chat(1000 + i) for i in range(2000)]
    held_out = [c for c in (reverse_chat(90_000 + i) for i in range(40)) if c not in train][:4]
    (sft.tmp / "reverse.jsonl").write_text(
        "".join(json.dumps({"messages": c}) + "\n" for c in train))
    assert prepare_main(["--tokenizer", str(sft.imported / "hf_tokenizer" / "tokenizer.json"),
                         "--input", str(sft.tmp / "reverse.jsonl"), "--out",
                         str(sft.tmp / "reverse"), "--format", "chat", "--no-progress"]) == 0
    workdir = sft.tmp / "reverse_run"
    shutil.copytree(sft.imported, workdir)
    prompts = [c[-2]["content"] for c in held_out]
    answers = [c[-1]["content"] for c in held_out]
    before = [_reply(capsys, workdir, p) for p in prompts[:2]]  # (each call compiles)
    cfg = load_config(workdir / "config.json", {
        "data.source": str(sft.tmp / "reverse"), "data.val_fraction": 0,
        "train.epochs": 6, "train.batch_size": 16, "optim.lr": 5e-3,
        "train.log_every": 50, "train.progress_bar": False, "checkpoint.every_steps": 0})
    lines = []
    result = loop.train(cfg, workdir, log=lines.append, devices=jax.devices()[:1])
    after = [_reply(capsys, workdir, p) for p in prompts]
    assert after == answers, (after, answers, "\n".join(map(str, lines)))
    assert sum(b == a for b, a in zip(before, answers)) == 0, before
    epochs = next(line for line in lines if "train.epochs=6 -> train.steps=" in str(line))
    assert f"train.steps={result.final_step} " in epochs
