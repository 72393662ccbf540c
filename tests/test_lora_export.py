"""A LoRA run's exports against Hugging Face PEFT (tests/hf_peer/peft_peer.py in .venv-torch):
the --adapter folder loads onto the run's --base export with peft.PeftModel.from_pretrained
and gives titanax's logits (base + adapters, unmerged); the default export (adapters merged)
equals peft's merge_and_unload() weight for weight and gives the same logits loaded as a plain
LlamaForCausalLM. Float32 throughout; GQA, every projection adapted (each of the export's
layout transforms: q/k/v heads_in, o heads_out, gate/up/down transpose)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from torch_peer import run_jobs, torch_python

from launch.export_hf import main as export_main
from tests.helpers.hf_runs import hf_small_config, make_run
from titanax.hf.exporter import export_hf
from titanax.parallel.mesh import single_device_mesh
from titanax.parallel.rules import model_context

RANK, ALPHA = 4, 8.0  # scale 2, as neither 1 nor rank would hide a wrong scaling


@pytest.fixture(scope="module")
def peft(tmp_path_factory):
    torch_python()  # skips here, before any work, when the peer is missing
    from titanax.generate import load_for_inference

    tmp = tmp_path_factory.mktemp("lora_export")
    make_run(tmp / "run", hf_small_config(**{"lora.rank": RANK, "lora.alpha": ALPHA}))
    export_main(["--workdir", str(tmp / "run"), "--out", str(tmp / "adapter"), "--adapter"])
    export_main(["--workdir", str(tmp / "run"), "--out", str(tmp / "base"), "--base",
                 "--dtype", "float32"])
    export_hf(tmp / "run", tmp / "merged", dtype="float32", progress=False)
    tokens = np.random.default_rng(0).integers(0, 384, (2, 24), dtype=np.int32)
    np.save(tmp / "tokens.npy", tokens)
    run_jobs("peft_peer.py", [{"base": str(tmp / "base"), "adapter": str(tmp / "adapter"),
                               "merged": str(tmp / "merged"), "tokens": str(tmp / "tokens.npy"),
                               "out": str(tmp)}], tmp)
    cfg, graphdef, state, _ = load_for_inference(tmp / "run")
    with model_context(single_device_mesh()):
        ours, _ = nnx.merge(graphdef, state)(jnp.asarray(tokens))
    return tmp, cfg, np.asarray(ours)


def test_peft_loads_the_adapter_export_and_gives_titanax_logits(peft):
    tmp, cfg, ours = peft
    config = json.loads((tmp / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    report = json.loads((tmp / "report.json").read_text())
    assert len(report["adapter_modules"]) == 7 * cfg.model.n_layers  # every one got its adapter
    base, adapted = np.load(tmp / "base.npy"), np.load(tmp / "peft.npy")
    assert np.abs(adapted - base).max() > 0.1  # the adapters matter at this tolerance's scale
    np.testing.assert_allclose(adapted, ours, atol=1e-4, rtol=1e-4)


def test_the_merged_export_equals_peft_merge_and_unload(peft):
    tmp, _, ours = peft
    report = json.loads((tmp / "report.json").read_text())
    assert not report["only_peft"] and not report["only_ours"]
    worst = max(report["max_abs_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-6, worst  # float32 W + 2 (B A): a few ulps of weights of size ~1
    np.testing.assert_allclose(np.load(tmp / "merged.npy"), ours, atol=1e-4, rtol=1e-4)
    index = json.loads((tmp / "merged" / "model.safetensors.index.json").read_text())
    assert not any("lora" in name for name in index["weight_map"])  # a plain model


def test_adapter_export_of_a_run_without_adapters_is_refused(tmp_path):
    make_run(tmp_path / "run", hf_small_config())
    with pytest.raises(ValueError, match="holds no LoRA adapters.*without --adapter"):
        export_hf(tmp_path / "run", tmp_path / "out", lora="adapter", progress=False)
    assert not (tmp_path / "out").exists()
