"""Qwen3 dense (models/qwen3), proven against transformers' Qwen3ForCausalLM (one .venv-torch
subprocess, tests/hf_peer/qwen3_peer.py) tied and untied: our export gives transformers'
logits, a transformers-saved model imports to its logits; and the parallel layouts compute
the one-device loss and gradients."""

import json
import types

import jax
import numpy as np
import pytest
from torch_peer import run_jobs

from tests.helpers.hf_runs import hf_small_config, load_run, make_run, titanax_logits
from tests.helpers.layouts import LAYOUTS, loss_and_grads, tiny_config
from titanax.hf.exporter import export_hf
from titanax.hf.folder import HFImportError, hf_arch
from titanax.hf.importer import import_hf, plan_import
from titanax.models import model_spec, preset

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

# head_dim * n_heads (128) != d_model (64), as in every real Qwen3; GQA 4:2; plain RoPE.
QWEN3 = {"model.arch": "qwen3", "model.head_dim": 32, "model.rope_theta": 1e6,
         "model.rope_scaling": "none", "model.norm_eps": 1e-6}
TIES = {"tied": True, "untied": False}


def _hf_config(tied: bool) -> dict:
    return {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 160,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "initializer_range": 0.2, "tie_word_embeddings": tied,
            "bos_token_id": 0, "eos_token_id": 1}


def qwen3_config(tied: bool):
    return hf_small_config(**QWEN3, **{"model.tie_embeddings": tied})


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
    """Tied and untied: a titanax Qwen3 run exported, and a random transformers Qwen3 saved,
    both scored by transformers in one subprocess."""
    tmp = tmp_path_factory.mktemp("qwen3")
    tokens = np.random.default_rng(0).integers(0, 384, (2, 48)).astype(np.int32)
    np.save(tmp / "tokens.npy", tokens)
    jobs = []
    for name, tied in TIES.items():
        make_run(tmp / f"run_{name}", qwen3_config(tied))
        export_hf(tmp / f"run_{name}", tmp / f"export_{name}", dtype="float32", progress=False)
        jobs += [{"op": "logits", "dir": str(tmp / f"export_{name}"),
                  "tokens": str(tmp / "tokens.npy"), "out": str(tmp / f"export_{name}.npy")},
                 {"op": "make", "dir": str(tmp / f"hf_{name}"), "config": _hf_config(tied),
                  "seed": 0, "tokens": str(tmp / "tokens.npy"),
                  "out": str(tmp / f"hf_{name}.npy")}]
    run_jobs("qwen3_peer.py", jobs, tmp)
    return types.SimpleNamespace(tmp=tmp, tokens=tokens)


@pytest.mark.parametrize("name", list(TIES))
def test_export_gives_transformers_logits(peer, name):
    cfg, graphdef, params = load_run(peer.tmp / f"run_{name}")
    ours = titanax_logits(cfg, graphdef, params, peer.tokens)
    theirs = np.load(peer.tmp / f"export_{name}.npy")
    assert ours.std() > 0.5
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    config = json.loads((peer.tmp / f"export_{name}" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 32
    assert config["tie_word_embeddings"] is TIES[name]
    index = json.loads((peer.tmp / f"export_{name}" / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) is not TIES[name]
    assert "model.layers.1.self_attn.k_norm.weight" in index["weight_map"]


@pytest.mark.parametrize("name", list(TIES))
def test_import_gives_transformers_logits(peer, name, tmp_path):
    hf_dir = peer.tmp / f"hf_{name}"
    assert hf_arch(hf_dir) == "qwen3"
    with pytest.raises(HFImportError, match=r"--set model.arch=qwen3"):
        plan_import(hf_dir, hf_small_config())  # a Llama config does not take a Qwen3 folder
    import_hf(hf_dir, qwen3_config(TIES[name]), tmp_path / "imported",
              devices=jax.devices()[:1], progress=False, log=lambda *_: None)
    cfg, graphdef, params = load_run(tmp_path / "imported")
    ours = titanax_logits(cfg, graphdef, params, peer.tokens)
    theirs = np.load(peer.tmp / f"hf_{name}.npy")
    assert theirs.std() > 0.5
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


def test_presets_have_the_published_sizes():
    count = lambda name: model_spec("qwen3").count_params(preset(name))  # noqa: E731
    assert preset("qwen3_0_6b").arch == "qwen3" and preset("qwen3_0_6b").tie_embeddings
    assert count("qwen3_0_6b") == 596_049_920  # 0.6B, 0.44B without the (tied) embedding
    assert count("qwen3_8b") == 8_190_735_360


@pytest.fixture(scope="module")
def one_device_qwen3():
    return loss_and_grads(tiny_config(**QWEN3_TINY, **{"mesh.data": 1}), jax.devices()[:1])


# test_parallel's tiny dimensions with Qwen3's q/k norms, an explicit head_dim and tied
# embeddings (the output layer's gradient flows into the embedding through every schedule).
QWEN3_TINY = {"model.arch": "qwen3", "model.head_dim": 16, "model.rope_scaling": "none",
              "model.tie_embeddings": True}


@pytest.mark.parametrize("name", ["tp2_fsdp4", "tp2_fsdp2_pp2_1f1b"])
def test_layout_matches_one_device(name, one_device_qwen3):
    ref_loss, ref_grads, _ = one_device_qwen3
    cfg = tiny_config(**QWEN3_TINY, **LAYOUTS[name])
    loss, grads, _ = loss_and_grads(cfg, jax.devices())
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert "output" not in grads and "q_norm" in grads["layers"]
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(r))
        assert scale > 0
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * scale)


def test_sliding_window_configs_are_refused():
    cfg = qwen3_config(False)
    hf = {**_hf_config(False), "model_type": "qwen3", "use_sliding_window": True}
    with pytest.raises(ValueError, match="sliding-window"):
        model_spec(cfg.model).hf.mismatches(hf, cfg.model)
