"""HF round trips that keep everything (issue 20), through the command lines: a tied Llama and
an Instruct-style one (eos list, sampling defaults, chat template, a config.json key titanax
does not know) go transformers -> launch.import_hf (no --config) -> launch.train 2 steps ->
launch.export_hf, load in transformers with the same GenerationConfig and chat template, and
generate greedily what launch.generate does; export -> import -> export changes nothing."""

import json
import pathlib
import types

import numpy as np
import pytest
from torch_peer import run_jobs

pytestmark = pytest.mark.usefixtures("devices8")  # launch.* take every (simulated) device

EOT, EOM = "<|eot_id|>", "<|eom_id|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|eot_id|>{% endfor %}")
BASE = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "initializer_range": 0.2,
        "bos_token_id": 0}
PROMPT = "def main():\n    return"
TRAIN = ["--set=train.steps=2", "--set=data.source=synthetic", "--set=train.log_every=1",
         "--set=train.eval_every=0", "--set=checkpoint.every_steps=0",
         "--set=checkpoint.async_save=false", "--set=train.progress_bar=false",
         "--set=train.peak_flops=1e12", "--set=optim.lr=1e-3", "--set=optim.warmup_steps=0"]


def _tokenizer(path: pathlib.Path) -> dict[str, int]:
    """A small byte-level BPE with Llama 3's specials (begin/end of text, eot, eom)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from titanax.data.tokenizer import train_bpe

    docs = ["def main():\n    return sorted(range(10))\n" * 3, "import os\nprint(1)\n" * 5]
    train_bpe(docs, 300, path)
    hf = HFTokenizer.from_file(str(path))
    hf.add_special_tokens([AddedToken(t, special=True) for t in (EOT, EOM)])
    hf.save(str(path))
    return {t: hf.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", EOT, EOM)}


def _cli(module: str, *argv: str, capsys=None) -> str:
    import importlib

    importlib.import_module(f"launch.{module}").main([str(a) for a in argv])
    return capsys.readouterr().out if capsys is not None else ""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("roundtrip")
    ids = _tokenizer(tmp / "tokenizer.json")
    eos = [ids["<|end_of_text|>"], ids[EOM], ids[EOT]]
    common = {"op": "make", "seed": 0, "tokenizer": str(tmp / "tokenizer.json"),
              "bos": "<|begin_of_text|>", "eos": "<|end_of_text|>"}
    tied = {**BASE, "tie_word_embeddings": True, "eos_token_id": eos[0]}
    instruct = {**BASE, "tie_word_embeddings": False, "eos_token_id": eos,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                "custom_key": "kept as is"}
    generation = {"bos_token_id": 0, "eos_token_id": eos, "do_sample": True,
                  "temperature": 0.6, "top_p": 0.9}
    run_jobs("roundtrip_peer.py", [
        {**common, "dir": str(tmp / "tied"), "config": tied},
        {**common, "dir": str(tmp / "instruct"), "config": instruct, "generation": generation,
         "chat_template": CHAT_TEMPLATE}], tmp)
    return types.SimpleNamespace(tmp=tmp, eos=eos)


def _import_train_export(src: pathlib.Path, tmp: pathlib.Path, capsys):
    work, out = tmp / f"{src.name}_run", tmp / f"{src.name}_export"
    _cli("import_hf", "--hf", src, "--workdir", work, "--set=execution.dtype=float32",
         "--set=execution.matmul_precision=highest", "--set=train.seq_len=32",
         "--set=train.batch_size=8")
    _cli("train", "--workdir", work, *TRAIN)
    _cli("export_hf", "--workdir", work, "--out", out, "--dtype", "float32")
    capsys.readouterr()
    text = _cli("generate", "--workdir", work, "--prompt", PROMPT, "--max-new-tokens", "6",
                capsys=capsys)
    return work, out, text.rstrip("\n")[len(PROMPT):]


def _tensors(folder: pathlib.Path) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", ["tied", "instruct"])
def test_import_train_export_keeps_everything(folders, name, tmp_path, capsys):
    from titanax.config import Config
    from titanax.data.tokenizer import Tokenizer

    src = folders.tmp / name
    work, out, ours = _import_train_export(src, tmp_path, capsys)
    cfg = Config.from_dict(json.loads((work / "config.json").read_text()))
    assert cfg.train.steps == 2 and cfg.data.bos  # trained, Llama 3 tokenizer: BOS on
    assert cfg.model.tie_embeddings == (name == "tied")
    tok = Tokenizer.load(cfg.data.tokenizer)
    assert pathlib.Path(cfg.data.tokenizer).parent == work / "hf_tokenizer"

    source, exported = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert exported["tie_word_embeddings"] is (name == "tied")
    assert ("lm_head.weight" in _tensors(out)) is (name != "tied")
    assert exported["dtype"] == exported["torch_dtype"] == "float32"
    assert exported["max_position_embeddings"] == 128
    assert exported["eos_token_id"] == source["eos_token_id"]
    if name == "instruct":
        assert exported["custom_key"] == "kept as is"
        assert exported["rope_scaling"]["original_max_position_embeddings"] == 32
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (src / f).read_bytes(), f

    prompt_ids = [tok.bos_id] + tok.encode(PROMPT)
    run_jobs("roundtrip_peer.py", [{"op": "generate", "dir": str(out), "source": str(src),
                                    "ids": prompt_ids, "max_new_tokens": 6,
                                    "out": str(tmp_path / "gen.json")}], tmp_path)
    theirs = json.loads((tmp_path / "gen.json").read_text())
    assert theirs["same_generation"], theirs["generation"]
    assert theirs["chat"] == theirs["source_chat"]
    if name == "instruct":
        assert theirs["eos"] == folders.eos and theirs["generation"]["top_p"] == 0.9
        assert theirs["chat"].startswith("<|start|>system\nbe brief<|eot_id|>")
    stop = theirs["eos"] if isinstance(theirs["eos"], list) else [theirs["eos"]]
    new = [t for t in theirs["new"] if t not in stop]  # ours never prints the eos
    assert len(theirs["new"]) > 0 and tok.decode(new) == ours
    assert ours == theirs["text"][:len(ours)]

    # export -> import -> export: the same tensors (bit for bit) and the same files.
    again = tmp_path / "again"
    _cli("import_hf", "--hf", out, "--workdir", tmp_path / "run2",
         "--set=model.max_seq_len=64")  # training shorter does not shrink the model's context
    _cli("export_hf", "--workdir", tmp_path / "run2", "--out", again, "--dtype", "float32")
    first, second = _tensors(out), _tensors(again)
    assert first.keys() == second.keys()
    for k, v in first.items():
        assert v.dtype == second[k].dtype and v.tobytes() == second[k].tobytes(), k
    assert json.loads((again / "config.json").read_text()) == exported
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / f).read_bytes() == (out / f).read_bytes(), f


def test_import_without_config_json_needs_a_config(folders, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes((folders.tmp / "tied" / "model.safetensors")
                                             .read_bytes())
    with pytest.raises(SystemExit):
        _cli("import_hf", "--hf", bare, "--workdir", tmp_path / "w")
    assert "has no config.json to take the model from; give --config" in capsys.readouterr().err
    np.testing.assert_equal((tmp_path / "w").exists(), False)
