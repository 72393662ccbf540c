"""Hugging Face interop of the machinery every architecture shares, on Llama, against
transformers (run in .venv-torch through tests/torch_peer.py): the export's shards, config.json
and tokenizer, export -> import identity in bfloat16, training resumes from an import, tied
embeddings, malformed inputs. Logits parity both ways for every architecture is the model
suite's (tests/test_model_suite.py)."""

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from torch_peer import run_jobs

from tests.helpers.hf_runs import (
    HF_CONFIG,
    TEXT,
    hf_small_config,
    load_run,
    make_run,
    titanax_logits,
)
from titanax.checkpoint.reader import CheckpointReader
from titanax.config import apply_overrides
from titanax.hf.exporter import export_hf, parse_size
from titanax.hf.importer import HFImportError, import_hf
from titanax.hf.safetensors_io import read_header, read_tensor
from titanax.parallel.mesh import single_device_mesh
from titanax.parallel.rules import model_context
from titanax.train.resolved import resolve

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices













@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """One transformers subprocess for the module: loads our export, and makes, saves and
    scores a random transformers Llama."""
    tmp = tmp_path_factory.mktemp("hf")
    cfg = hf_small_config()
    run = tmp / "run"
    original = make_run(run, cfg)
    # A small shard limit, so the export is several shards joined by the index.
    exported = export_hf(run, tmp / "export", dtype="float32", max_shard_bytes=60_000,
                         progress=False)
    tokens = np.random.default_rng(0).integers(0, 384, (2, 48)).astype(np.int32)
    np.save(tmp / "tokens.npy", tokens)
    run_jobs("llama_peer.py", [
        {"op": "logits", "dir": str(tmp / "export"), "tokens": str(tmp / "tokens.npy"),
         "out": str(tmp / "export_logits.npy"), "text": TEXT, "tok_out": str(tmp / "tok.json")},
        {"op": "make", "dir": str(tmp / "hf_random"), "config": HF_CONFIG, "seed": 0,
         "tokens": str(tmp / "tokens.npy"), "out": str(tmp / "random_logits.npy")},
    ], tmp)
    return types.SimpleNamespace(tmp=tmp, cfg=cfg, run=run, original=original, tokens=tokens,
                                 exported=exported)


def test_export_gives_transformers_logits(peer):
    cfg, graphdef, params = load_run(peer.run)
    ours = titanax_logits(cfg, graphdef, params, peer.tokens)
    theirs = np.load(peer.tmp / "export_logits.npy")
    assert ours.std() > 0.5  # logits of a real size, not near-zero noise
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)

    out = peer.tmp / "export"
    assert peer.exported.shards > 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {
        f"model-{i:05d}-of-{peer.exported.shards:05d}.safetensors"
        for i in range(1, peer.exported.shards + 1)}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 10000.0
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)

    from titanax.data.tokenizer import Tokenizer

    tok = Tokenizer.load(peer.run / "tokenizer.json")
    hf_tok = json.loads((peer.tmp / "tok.json").read_text())
    assert hf_tok["ids"] == tok.encode(TEXT)
    assert (hf_tok["bos_token"], hf_tok["eos_token"]) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (hf_tok["config_bos"], hf_tok["config_eos"]) == (tok.bos_id, tok.eos_id)
    assert hf_tok["rope"]["rope_type"] == "llama3" and hf_tok["rope"]["factor"] == 8.0
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}


def test_export_then_import_is_the_identity(peer, tmp_path):
    # Imported into a sharded state (fsdp=2, tensor=2), read back without restoring.
    cfg = apply_overrides(peer.cfg, {"mesh.fsdp": 2, "mesh.tensor": 2})
    work = tmp_path / "roundtrip"
    import_hf(peer.tmp / "export", cfg, work, devices=jax.devices()[:4], progress=False,
              log=lambda *_: None)
    reader = CheckpointReader(work / "checkpoints")
    assert reader.step == 0 and set(reader.params()) == set(peer.original)
    for path, value in peer.original.items():
        np.testing.assert_array_equal(reader.read(path), value, err_msg=".".join(path))
    # The tokenizer came along, and the saved config points at it.
    assert (work / "hf_tokenizer" / "tokenizer.json").is_file()
    assert reader.config_dict["data"]["tokenizer"] == str(work / "hf_tokenizer" / "tokenizer.json")

    # bfloat16 export of the round-tripped run: HF's rounding of the same values, and the
    # safetensors package reads our streamed files.
    out = tmp_path / "bf16"
    export_hf(work, out, dtype="bfloat16", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
    header, meta = read_header(shard)
    assert meta == {"format": "pt"} and {i.dtype for i in header.values()} == {"BF16"}
    q = read_tensor(shard, header["model.layers.1.self_attn.q_proj.weight"])
    want = peer.original[("layers", "wq")][1].reshape(64, 64).T.astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(q, want)
    from safetensors.numpy import load_file

    f32_shard = peer.tmp / "export" / json.loads(
        (peer.tmp / "export" / "model.safetensors.index.json").read_text())["weight_map"]["lm_head.weight"]
    np.testing.assert_array_equal(load_file(f32_shard)["lm_head.weight"],
                                  peer.original[("output",)].T)
    assert (out / "tokenizer_config.json").read_text() == (
        peer.tmp / "export" / "tokenizer_config.json").read_text()


def test_training_resumes_from_an_import(peer, tmp_path):
    from titanax.data.pipeline import build_data
    from titanax.train.loop import train
    from titanax.train.step import make_loss_fn

    cfg = apply_overrides(peer.cfg, {"train.steps": 1, "train.log_every": 1,
                                     "checkpoint.every_steps": 0, "optim.lr": 1e-3,
                                     "train.peak_flops": 1e12})  # no CPU FLOP/s probe
    work = tmp_path / "finetune"
    import_hf(peer.tmp / "hf_random", cfg, work, devices=jax.devices()[:1], progress=False,
              log=lambda *_: None)
    _, graphdef, params = load_run(work)
    batch = next(build_data(cfg, work, 0, 1).train_iterator())
    with model_context(single_device_mesh()):
        want = float(make_loss_fn(cfg, graphdef, resolve(cfg).spec)(params,
                                                 {k: jnp.asarray(v) for k, v in batch.items()}))
    logs = []
    result = train(cfg, work, log=logs.append, devices=jax.devices()[:1])
    assert any("resumed from" in line and "/0 at step 0" in line for line in logs), logs
    np.testing.assert_allclose(result.losses[1], want, rtol=1e-5)


def _write_hf(folder: pathlib.Path, tensors: dict, config: dict) -> pathlib.Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_malformed_hf_folders_fail_before_writing(peer, tmp_path):
    from safetensors.numpy import load_file

    good = load_file(str(peer.tmp / "hf_random" / "model.safetensors"))
    config = json.loads((peer.tmp / "hf_random" / "config.json").read_text())
    q0, up1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"
    k1 = "model.layers.1.self_attn.k_proj.weight"
    cases = {
        "missing": ({k: v for k, v in good.items() if k != up1}, config,
                    rf"tensor {up1} is missing \(expected shape \[160, 64\]\)"),
        "shape": ({**good, q0: good[q0][:60]}, config,
                  rf"tensor {q0}: expected shape \[64, 64\] from the config, found \[60, 64\]"),
        "dtype": ({**good, k1: good[k1].astype(np.float16)}, config,
                  rf"tensor {k1}: expected dtype F32 .*found F16"),
        "config": (good, {**config, "num_key_value_heads": 4},
                   r"model.n_kv_heads=2 but config.json says 4 \(--set model.n_kv_heads=4\)"),
        "extra": ({**good, "model.layers.2.mlp.up_proj.weight": good[up1]}, config,
                  r"unexpected tensor model.layers.2.mlp.up_proj.weight"),
    }
    for case, (tensors, cfg_json, message) in cases.items():
        folder = _write_hf(tmp_path / case, tensors, cfg_json)
        work = tmp_path / f"work_{case}"
        with pytest.raises(HFImportError, match=message):
            import_hf(folder, peer.cfg, work, devices=jax.devices()[:1], progress=False)
        assert not work.exists(), case

    truncated = tmp_path / "truncated"
    shutil.copytree(peer.tmp / "hf_random", truncated)
    f = truncated / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(HFImportError, match=r"truncated"):
        import_hf(truncated, peer.cfg, tmp_path / "work_trunc", progress=False)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(HFImportError, match=r"pickled weights, which titanax never loads"):
        import_hf(pickled, peer.cfg, tmp_path / "work_pickled", progress=False)
    assert not (tmp_path / "work_trunc").exists() and not (tmp_path / "work_pickled").exists()


def test_export_errors_and_sizes(peer, tmp_path, capsys):
    from launch.export_hf import main

    with pytest.raises(SystemExit):
        main(["--workdir", str(peer.run), "--out", str(peer.tmp / "export")])  # not empty
    assert "exists and is not an empty folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--workdir", str(peer.run), "--out", str(tmp_path / "x"), "--step", "7"])
    assert "no checkpoint for step 7 under" in (err := capsys.readouterr().err)
    assert "steps present: [0]" in err
    with pytest.raises(SystemExit):
        main(["--workdir", str(tmp_path / "nothing"), "--out", str(tmp_path / "y")])
    assert "no checkpoint under" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    # A killed export (kill -9: a real process, now dead) left its hidden partial folder;
    # the next export to that --out removes it. Another host's may still be writing: kept.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".z.partial-{socket.gethostname()}-{dead.pid}"
    elsewhere = tmp_path / ".z.partial-otherhost-1"
    for folder in (stale, elsewhere):
        folder.mkdir()
        (folder / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1000)
    main(["--workdir", str(peer.run), "--out", str(tmp_path / "z")])
    assert not stale.exists() and elsewhere.exists() and (tmp_path / "z" / "config.json").is_file()
    # SIGTERM during an export: one line, exit 143, no partial folder left behind.
    from titanax.hf import exporter

    real = exporter._write_configs
    def interrupted(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    exporter._write_configs = interrupted
    try:
        with pytest.raises(SystemExit) as e:
            main(["--workdir", str(peer.run), "--out", str(tmp_path / "w")])
    finally:
        exporter._write_configs = real
    err = capsys.readouterr().err.strip()
    assert e.value.code == 143 and err.count("error:") == 1 and \
        "error: stopped by SIGTERM" in err and "Traceback" not in err, err
    assert not (tmp_path / "w").exists() and not list(tmp_path.glob(".w.partial-*"))
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30
    assert parse_size("1500") == 1500 and parse_size("0.5MB") == 500_000
    with pytest.raises(ValueError, match="expected a number"):
        parse_size("5 gigs")


def test_tied_embeddings_become_the_output_layer(peer, tmp_path):
    from safetensors.numpy import load_file

    tensors = load_file(str(peer.tmp / "hf_random" / "model.safetensors"))
    del tensors["lm_head.weight"]
    config = {**json.loads((peer.tmp / "hf_random" / "config.json").read_text()),
              "tie_word_embeddings": True}
    folder = _write_hf(tmp_path / "tied", tensors, config)
    import_hf(folder, peer.cfg, tmp_path / "work", devices=jax.devices()[:1], progress=False,
              log=lambda *_: None)
    reader = CheckpointReader(tmp_path / "work" / "checkpoints")
    np.testing.assert_array_equal(reader.read(("output",)),
                                  tensors["model.embed_tokens.weight"].T)


def test_tied_llama_exports_without_lm_head_and_imports_back(tmp_path):
    """model.tie_embeddings (Llama 3.2 1B/3B): no 'output' parameter, config.json says
    tie_word_embeddings and no lm_head is written; the folder imports back unchanged."""
    cfg = hf_small_config(**{"model.tie_embeddings": True})
    original = make_run(tmp_path / "run", cfg)
    assert ("output",) not in original
    export_hf(tmp_path / "run", tmp_path / "export", dtype="float32", progress=False)
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in index["weight_map"]
    import_hf(tmp_path / "export", cfg, tmp_path / "back", devices=jax.devices()[:1],
              progress=False, log=lambda *_: None)
    reader = CheckpointReader(tmp_path / "back" / "checkpoints")
    assert set(reader.params()) == set(original)
    np.testing.assert_array_equal(reader.read(("embed",)), original[("embed",)])
    # An untied folder cannot go into a tied config (the reverse is fine, see above).
    from titanax.models import model_spec

    untied = {**config, "tie_word_embeddings": False}
    assert model_spec(cfg.model).hf.mismatches(untied, cfg.model) == [
        "model.tie_embeddings=True but config.json says False (--set model.tie_embeddings=False)"]
