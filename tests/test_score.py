"""launch.score against transformers (tests/hf_peer/score_peer.py in .venv-torch): a random
Llama saved by transformers (the round-trip tests' `make` job: a Llama 3-style tokenizer whose
post-processor adds BOS, and Llama 3's chat template) is imported with launch.import_hf, and
the per-token log-probs, losses and token ids of texts and chats equal transformers' on the
same folder: tokenizer(text) / apply_chat_template, model(ids), labels=ids (and labels -100
over a chat's prompt for the reply's loss). Bad input is one error line, exit 2."""

from __future__ import annotations

import json
import math
import re
import types

import numpy as np
import pytest
from torch_peer import run_jobs, torch_python

from launch.import_hf import main as import_main
from launch.score import main as score_main
from tests.helpers.chat import LLAMA3, SPECIALS, special_tokenizer

TEXTS = ["def main():\n    return sorted(range(10))\n",
         "import os\nprint(os.getcwd())  # caf\u00e9 \u2615",
         "user text that writes <|eot_id|> itself"]  # a special token in the text: its id
CHATS = [[{"role": "system", "content": "Answer briefly."},
          {"role": "user", "content": "def main():"},
          {"role": "assistant", "content": "return sorted(range(10))"}],
         [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "print(1)"},
          {"role": "user", "content": "class A:"}, {"role": "assistant", "content": "pass"}],
         [{"role": "user", "content": "no reply yet"}]]
# float32 on both sides, the same sums taken in other orders (dot products of K <= 160 over 2
# layers, then a 320-way log-sum-exp): the log-probs reach -12, where one float32 ulp is
# 9.5e-7, and the largest difference measured is 4.8e-6 (5 ulps). 2e-5 is 21 ulps there, and
# far below what a wrong token, position or BOS changes (log-probs spread over ~[-12, 0]).
TOL = 2e-5


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    torch_python()  # skips here, before any work, when the peer is missing
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.processors import TemplateProcessing

    tmp = tmp_path_factory.mktemp("score")
    tok_path = special_tokenizer(tmp / "tokenizer.json", "".join(TEXTS) + "system user "
                                 "assistant Answer briefly. class A: pass print(1)")
    hf = HFTokenizer.from_file(str(tok_path))  # as Llama 3's tokenizer.json: BOS on each text
    bos = hf.token_to_id(SPECIALS[0])
    hf.post_processor = TemplateProcessing(single=f"{SPECIALS[0]} $A",
                                           special_tokens=[(SPECIALS[0], bos)])
    hf.save(str(tok_path))
    config = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 160,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
              "initializer_range": 0.2, "bos_token_id": bos,
              "eos_token_id": hf.token_to_id("<|eot_id|>")}
    run_jobs("roundtrip_peer.py", [
        {"op": "make", "dir": str(tmp / "hf"), "config": config, "seed": 0,
         "tokenizer": str(tok_path), "bos": SPECIALS[0], "eos": "<|eot_id|>",
         "chat_template": LLAMA3}], tmp)
    import_main(["--hf", str(tmp / "hf"), "--workdir", str(tmp / "run"),
                 "--set=execution.matmul_precision=highest"])
    run_jobs("score_peer.py", [{"dir": str(tmp / "hf"), "texts": TEXTS, "chats": CHATS,
                                "out": str(tmp / "peer.json")}], tmp)
    (tmp / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    score_main(["--workdir", str(tmp / "run"), "--input", str(tmp / "texts.jsonl"),
                "--json", str(tmp / "texts.json")])
    score_main(["--workdir", str(tmp / "run"), "--input", str(tmp / "chats.jsonl"), "--chat",
                "--json", str(tmp / "chats.json")])
    ours = [json.loads((tmp / f).read_text()) for f in ("texts.json", "chats.json")]
    return types.SimpleNamespace(tmp=tmp, bos=bos, peer=json.loads((tmp / "peer.json").read_text()),
                                 ours=ours[0]["texts"] + ours[1]["texts"], report=ours[0])


def test_log_probs_and_losses_are_transformers(scored):
    worst = 0.0
    for i, (ours, theirs) in enumerate(zip(scored.ours, scored.peer, strict=True)):
        rows = ours["token_logprobs"]
        assert [r["id"] for r in rows] == theirs["ids"], i  # the same tokens, BOS included
        assert rows[0]["logprob"] is None and ours["predicted_tokens"] == len(rows) - 1
        lp = np.array([r["logprob"] for r in rows[1:]])
        diff = np.abs(lp - np.array(theirs["logprobs"])).max()
        worst = max(worst, diff)
        assert diff < TOL, (i, diff)
        assert abs(ours["loss"] - theirs["loss"]) < TOL, i
        assert math.isclose(ours["perplexity"], math.exp(ours["loss"]))
        chat = CHATS[i - len(TEXTS)] if i >= len(TEXTS) else []
        if [m["role"] for m in chat].count("assistant") == 1:  # labels -100 over the prompt
            assert abs(ours["assistant_loss"] - theirs["assistant_loss"]) < TOL, i
    print(f"max |d logprob| vs transformers: {worst:.3g}")
    texts = scored.ours[:len(TEXTS)]
    assert all(t["token_logprobs"][0]["id"] == scored.bos for t in texts)
    assert scored.report["step"] == 0 and "assistant_loss" not in texts[0]


def test_chat_marks_the_assistant_tokens(scored):
    one, two, none = scored.ours[len(TEXTS):]
    assert "assistant_loss" not in none and "assistant" not in none["token_logprobs"][1]
    for chat in (one, two):
        marked = [r for r in chat["token_logprobs"] if r.get("assistant")]
        assert len(marked) == chat["assistant_tokens"] > 0
        assert marked[-1]["token"] == "<|eot_id|>"  # the reply through its end of turn
        assert math.isclose(chat["assistant_loss"],
                            -sum(r["logprob"] for r in marked) / len(marked), rel_tol=1e-9)
    # both replies of the two-turn chat, not the user's turn between them
    assert sum(r["token"] == "<|eot_id|>" for r in two["token_logprobs"] if r.get("assistant")) == 2


def test_text_flag_prints_the_same_report(scored, capsys):
    capsys.readouterr()
    score_main(["--workdir", str(scored.tmp / "run"), "--text", TEXTS[0]])
    out = capsys.readouterr().out.splitlines()
    first = scored.ours[0]
    head = re.match(r"text 1: loss (\S+), perplexity ", out[0])
    assert head and float(head[1]) == pytest.approx(first["loss"], abs=TOL), out[0]  # printed to 6 places
    assert f"{first['tokens']} tokens ({first['predicted_tokens']} predicted)" in out[0]
    assert out[1].split() == ["-", json.dumps(SPECIALS[0])]
    assert float(out[2].split()[0]) == pytest.approx(first["token_logprobs"][1]["logprob"],
                                                     abs=TOL)  # batched apart: other padding
    assert len(out) == 1 + first["tokens"] + 1 and out[-1].startswith("[step 0 of ")


@pytest.mark.parametrize("argv, contains", [
    (["--workdir", "{tmp}/nowhere", "--text", "x"], "no such folder"),
    (["--workdir", "{run}", "--text", ""], "the text is empty"),
    (["--workdir", "{run}"], "--text TEXT or --input FILE.jsonl"),
    (["--workdir", "{run}", "--text", "x", "--input", "{tmp}/texts.jsonl"], "not both"),
    (["--workdir", "{run}", "--input", "{tmp}/bad.jsonl"], "bad.jsonl:2: no \"text\" field"),
    (["--workdir", "{run}", "--input", "{tmp}/texts.jsonl", "--chat"], "no \"messages\" field"),
    (["--workdir", "{run}", "--text", "hi", "--chat"], "give the conversation as JSON"),
    (["--workdir", "{run}", "--text", "\u2615" * 200], "more than the model's max_seq_len=128"),
    (["--workdir", "{run}", "--text", "x", "--step", "7"], "no checkpoint for step 7"),
])
def test_bad_input_is_one_line_exit_2(scored, capsys, argv, contains):
    (scored.tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    argv = [a.format(tmp=scored.tmp, run=scored.tmp / "run") for a in argv]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        score_main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("error:") == 1 and "Traceback" not in err, err
    assert contains in err, err
