"""Chat templates (titanax/data/chat.py): read from where transformers saves them, rendered in
its Jinja environment, the assistant spans an SFT loss bears on, and launch.generate --chat."""

from __future__ import annotations

import json

import pytest

from tests.helpers.chat import LLAMA3, special_tokenizer
from tests.helpers.small import run_small
from titanax.data.chat import ChatError, ChatTemplate, assistant_spans

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "reverse 1 2 3"},
        {"role": "assistant", "content": "3 2 1"},
        {"role": "user", "content": "reverse a b"},
        {"role": "assistant", "content": "b a"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A small byte-level BPE with Llama 3's special tokens, and its folder's template."""
    from titanax.data.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("tok")
    special_tokenizer(folder / "tokenizer.json", "reverse 1 2 3 a b\nBe brief.\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "special": True}, "chat_template": LLAMA3}))
    return folder, Tokenizer.load(folder / "tokenizer.json")


def test_template_is_read_where_transformers_saves_it(tmp_path, tokenizer):
    folder, _ = tokenizer
    t = ChatTemplate.from_folder(folder)
    assert t.source == LLAMA3 and dict(t.special)["eos_token"] == "<|eot_id|>"
    assert t.render(CHAT[:2], add_generation_prompt=True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nreverse 1 2 3<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # transformers 5's chat_template.jinja wins over the config's key; a list takes 'default'
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "tools"}, {"name": "default", "template": "D"}]}))
    assert ChatTemplate.from_folder(tmp_path).source == "D"
    (tmp_path / "chat_template.jinja").write_text("{% generation %}J{% endgeneration %}")
    assert ChatTemplate.from_folder(tmp_path).render(CHAT) == "J"
    assert ChatTemplate.from_folder(tmp_path.parent) is None  # no template at all


def test_bad_conversations_and_templates_are_named():
    t = ChatTemplate("{{ raise_exception('no system role') }}", "x/chat_template.jinja")
    with pytest.raises(ChatError, match="x/chat_template.jinja cannot render.*no system role"):
        t.render(CHAT)
    for bad, what in (([], "non-empty list"), ([{"role": "bot", "content": "x"}], "message 0"),
                      ([{"role": "user", "content": ["x"]}], "message 0")):
        with pytest.raises(ChatError, match=what):
            ChatTemplate(LLAMA3, "t").render(bad)


def test_loss_covers_each_assistant_reply_and_its_end_of_turn(tokenizer):
    folder, tok = tokenizer
    ids, mask = assistant_spans(ChatTemplate.from_folder(folder), CHAT, tok.encode_rendered)
    assert ids == tok.encode_rendered(ChatTemplate.from_folder(folder).render(CHAT))
    # the template's special tokens are their ids (as apply_chat_template tokenizes them), but
    # the same text in a user's own words stays characters
    eot = tok._tok.token_to_id("<|eot_id|>")
    assert ids.count(eot) == 5 and tok.encode("<|eot_id|>").count(eot) == 0
    spans, run = [], []
    for t, m in zip(ids, mask):
        if m:
            run.append(t)
        elif run:
            spans.append(run)
            run = []
    spans += [run] if run else []
    # exactly the replies and their <|eot_id|>: no header, no prompt, nothing else
    assert [tok.decode(s) for s in spans] == ["3 2 1<|eot_id|>", "b a<|eot_id|>"]
    assert [s[-1] for s in spans] == [eot, eot]
    with pytest.raises(ChatError, match="no assistant message"):
        assistant_spans(ChatTemplate.from_folder(folder), CHAT[:2], tok.encode_rendered)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A small run trained one step (its tokenizer in the workdir)."""
    path = tmp_path_factory.mktemp("chat") / "run"
    run_small(path, 1, **{"checkpoint.every_steps": 1})
    return path


def _generate(capsys, *argv) -> tuple[int, str, str]:
    """launch.generate in this process: (exit code, stdout, stderr)."""
    from launch.generate import main

    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_chat_renders_the_prompt_as_a_user_turn(run, tokenizer, capsys):
    folder, _ = tokenizer
    code, _, err = _generate(capsys, "--workdir", run, "--prompt", "hi", "--chat")
    assert code == 2 and err.startswith("error: --chat: ") and "has no chat template" in err, err
    code, _, err = _generate(capsys, "--workdir", run, "--prompt", "hi", "--system", "x")
    assert code == 2 and "--system needs --chat" in err, err
    (run / "tokenizer_config.json").write_text((folder / "tokenizer_config.json").read_text())
    code, out, err = _generate(capsys, "--workdir", run, "--prompt", "hi", "--chat",
                               "--system", "Be brief.", "--max-new-tokens", "4")
    assert code == 0 and "[4 tokens from step 1" in err, err


def test_generate_samples_in_the_dtype_asked_for(run):
    """An imported model computes in its config.json's dtype (test_hf_dtype.py); --dtype (here
    load_for_inference's dtype) samples in another."""
    import jax

    from titanax.generate import generate, load_for_inference

    got = {}
    for dtype in (None, "bfloat16"):
        cfg, graphdef, params, step = load_for_inference(run, dtype=dtype,
                                                         devices=jax.devices()[:1])
        got[dtype] = cfg.execution.dtype
        assert step == 1 and len(list(generate(cfg, graphdef, params, [5, 6, 7],
                                               max_new_tokens=3))) == 3
    assert got == {None: "float32", "bfloat16": "bfloat16"}  # the run's, then the one asked
