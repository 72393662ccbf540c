"""The model suite: the checks every architecture under models/ passes, against transformers
(tests/hf_peer/model_peer.py, one .venv-torch subprocess for all of them) and against itself
on one device. tests/test_model_suite.py runs it for every entry of MODELS; a new architecture
is one entry here.

  export parity   our export, loaded by transformers, gives our logits
  import parity   a random transformers model, saved and imported, gives its logits
  param count     count_params equals transformers' parameter count
  round trip      export then import gives identical tensors (into a sharded state)
  layout          a TP x FSDP x PP (1f1b) layout gives the one-device loss and gradients
                  (tests/test_parallel.py runs every layout on Llama's layer; MoE models,
                  which refuse pipeline parallelism, have theirs in tests/test_moe_model.py)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import numpy as np

from tests.helpers.hf_runs import HF_CONFIG, hf_small_config, load_run, make_run, titanax_logits
from tests.helpers.layouts import LAYOUTS, assert_matches, loss_and_grads, tiny_config
from titanax.checkpoint.reader import CheckpointReader
from titanax.config import ConfigError, apply_overrides
from titanax.hf.exporter import export_hf
from titanax.hf.importer import import_hf
from titanax.models import model_spec
from titanax.models.common.block import BlockOptions, DecoderBlock
from titanax.parallel.mesh import single_device_mesh
from titanax.parallel.rules import model_context


@dataclasses.dataclass(frozen=True)
class ModelCase:
    hf_class: str  # transformers' class of this architecture
    model_type: str  # config.json's model_type
    overrides: dict  # --set on top of hf_runs.HF_SMALL (d 64, 2 layers, vocab 384)
    hf_config: dict  # kwargs of the random transformers model of the same dimensions
    tiny: dict  # --set on top of layouts.TINY for the layout check
    # False where tests/test_parallel.py already runs this model's layer over every layout:
    # Llama's (the common DecoderBlock with default options, untied), which Mistral is too.
    # check_layout asserts that the model really is that layer before it skips.
    layout: bool = True
    # The test file that runs this model's layouts instead, where LAYOUT cannot run: MoE
    # models refuse pipeline parallelism (check_layout asserts the refusal before it skips).
    layouts_in: str | None = None


_PLAIN_ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
_HF_DIMS = {k: HF_CONFIG[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                      "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "max_position_embeddings",
                                      "initializer_range", "bos_token_id", "eos_token_id")}

# Between them: untied and tied output layers, llama3 RoPE scaling and plain RoPE, head_dim
# * heads == d_model and != d_model, with and without per-head q/k norms; mixtures of experts
# with the top-k weights renormalised (Mixtral, top 2 of 4) and not (Qwen3-MoE, top 3 of 8).
MODELS = {
    "llama3": ModelCase("LlamaForCausalLM", "llama", {}, HF_CONFIG, {}, layout=False),
    "qwen3": ModelCase(
        "Qwen3ForCausalLM", "qwen3",
        {"model.arch": "qwen3", "model.head_dim": 32, "model.rope_theta": 1e6,
         "model.rope_scaling": "none", "model.norm_eps": 1e-6, "model.tie_embeddings": True},
        {**_HF_DIMS, **_PLAIN_ROPE, "head_dim": 32, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": True},
        {"model.arch": "qwen3", "model.head_dim": 16, "model.rope_scaling": "none",
         "model.tie_embeddings": True}),
    "mistral": ModelCase(
        "MistralForCausalLM", "mistral",
        {"model.arch": "mistral", "model.head_dim": 32, "model.rope_theta": 1e6,
         "model.rope_scaling": "none"},
        {**_HF_DIMS, **_PLAIN_ROPE, "head_dim": 32, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "sliding_window": None},
        {"model.arch": "mistral", "model.head_dim": 16, "model.rope_scaling": "none"},
        layout=False),
    "mixtral": ModelCase(
        "MixtralForCausalLM", "mixtral",
        {"model.arch": "mixtral", "model.head_dim": 32, "model.rope_theta": 1e6,
         "model.rope_scaling": "none", "model.n_experts": 4, "model.experts_per_token": 2},
        {**_HF_DIMS, **_PLAIN_ROPE, "head_dim": 32, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "sliding_window": None, "num_local_experts": 4,
         "num_experts_per_tok": 2},
        {"model.arch": "mixtral", "model.n_experts": 4}, layouts_in="tests/test_moe_model.py"),
    "qwen3_moe": ModelCase(
        "Qwen3MoeForCausalLM", "qwen3_moe",
        {"model.arch": "qwen3_moe", "model.head_dim": 32, "model.rope_theta": 1e6,
         "model.rope_scaling": "none", "model.norm_eps": 1e-6, "model.ffn_dim": 48,
         "model.n_experts": 8, "model.experts_per_token": 3, "model.norm_topk_prob": False},
        {**_HF_DIMS, **_PLAIN_ROPE, "head_dim": 32, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": False, "moe_intermediate_size": 48, "num_experts": 8,
         "num_experts_per_tok": 3, "norm_topk_prob": False},
        {"model.arch": "qwen3_moe", "model.n_experts": 8}, layouts_in="tests/test_moe_model.py"),
}

LAYOUT = "tp2_fsdp2_pp2_1f1b"  # tensor, FSDP and a pipeline (1f1b) at once
_TINY = {"model.n_layers": 4}  # two layers per pipeline stage


def hf_config_of(name: str):
    return hf_small_config(**MODELS[name].overrides)


def prepare(name: str, tmp: pathlib.Path, tokens_path: pathlib.Path) -> tuple[dict, list]:
    """A titanax run of model `name` and its export under tmp/name; (the run's parameters by
    path, the peer jobs that score the export and make a random transformers model)."""
    case, out = MODELS[name], tmp / name
    original = make_run(out / "run", hf_config_of(name))
    export_hf(out / "run", out / "export", dtype="float32", progress=False)
    jobs = [{"op": "logits", "dir": str(out / "export"), "class": case.hf_class,
             "tokens": str(tokens_path), "out": str(out / "export_logits.npy")},
            {"op": "make", "model_type": case.model_type, "config": case.hf_config, "seed": 0,
             "dir": str(out / "hf"), "tokens": str(tokens_path),
             "out": str(out / "hf_logits.npy"), "count_out": str(out / "hf_count.json")},
            {"op": "greedy", "dir": str(out / "export"), "ids": greedy_prompt(tokens_path),
             "max_new_tokens": GREEDY_TOKENS, "out": str(out / "greedy.json")}]
    return original, jobs


GREEDY_TOKENS = 8


def greedy_prompt(tokens_path: pathlib.Path) -> list[int]:
    return [int(t) for t in np.load(tokens_path)[0, :12]]


def check_greedy(name: str, tmp: pathlib.Path):
    """Our greedy continuation (generate.py: prefill, then one token at a time through the KV
    cache) of the export's prompt is transformers' (generate, do_sample=False)."""
    from titanax.generate import generate

    cfg, graphdef, params = load_run(tmp / name / "run")
    with model_context(single_device_mesh()):
        ours = list(generate(cfg, graphdef, params, greedy_prompt(tmp / "tokens.npy"),
                             max_new_tokens=GREEDY_TOKENS))
    assert ours == json.loads((tmp / name / "greedy.json").read_text())


def check_export_parity(name: str, tmp: pathlib.Path, tokens):
    cfg, graphdef, params = load_run(tmp / name / "run")
    ours = titanax_logits(cfg, graphdef, params, tokens)
    assert ours.std() > 0.5  # logits of a real size, not near-zero noise
    np.testing.assert_allclose(np.load(tmp / name / "export_logits.npy"), ours, atol=1e-4,
                               rtol=0)
    config = json.loads((tmp / name / "export" / "config.json").read_text())
    assert config["architectures"] == [MODELS[name].hf_class]


def check_import_parity(name: str, tmp: pathlib.Path, tokens, work: pathlib.Path):
    import_hf(tmp / name / "hf", hf_config_of(name), work, devices=jax.devices()[:1],
              progress=False, log=lambda *_: None)
    cfg, graphdef, params = load_run(work)
    theirs = np.load(tmp / name / "hf_logits.npy")
    assert theirs.std() > 0.5
    np.testing.assert_allclose(titanax_logits(cfg, graphdef, params, tokens), theirs,
                               atol=1e-4, rtol=0)


def check_param_count(name: str, tmp: pathlib.Path):
    model = hf_config_of(name).model
    theirs = json.loads((tmp / name / "hf_count.json").read_text())
    assert model_spec(model).count_params(model) == theirs


def check_round_trip(name: str, tmp: pathlib.Path, original: dict, work: pathlib.Path):
    """Our export imported into a sharded state (fsdp 2, tensor 2), read back unrestored."""
    cfg = apply_overrides(hf_config_of(name), {"mesh.fsdp": 2, "mesh.tensor": 2})
    import_hf(tmp / name / "export", cfg, work, devices=jax.devices()[:4], progress=False,
              log=lambda *_: None)
    reader = CheckpointReader(work / "checkpoints")
    assert set(reader.params()) == set(original)
    for path, value in original.items():
        np.testing.assert_array_equal(reader.read(path), value, err_msg=".".join(path))


def is_llamas_layer(name: str) -> bool:
    """Whether model `name` computes Llama's layer (what tests/test_parallel.py runs)."""
    cfg = hf_config_of(name).model
    build = model_spec(cfg).build
    return (build.block_cls is DecoderBlock and build.block_options == BlockOptions()
            and not cfg.tie_embeddings)


def check_layout(name: str) -> str | None:
    """The layout's loss and gradients equal one device's; None when it ran, else why not
    (nothing run): the model's layer is the one test_parallel checks, or the model refuses
    LAYOUT and `layouts_in` checks its layouts."""
    case = MODELS[name]
    over = {**_TINY, **case.tiny}
    if case.layouts_in is not None:
        try:
            tiny_config(**over, **LAYOUTS[LAYOUT])
        except ConfigError as e:
            assert str(e).startswith("pipeline.schedule: '1f1b'"), e
            return f"{name} refuses the 1f1b pipeline: {case.layouts_in} runs its layouts"
        raise AssertionError(f"{name} accepts {LAYOUT}: drop layouts_in")
    if not case.layout:
        assert is_llamas_layer(name), f"{name} is not Llama's layer: set layout=True"
        return f"{name} computes Llama's layer: tests/test_parallel.py runs its layouts"
    one = loss_and_grads(tiny_config(**over, **{"mesh.data": 1}), jax.devices()[:1])
    got = loss_and_grads(tiny_config(**over, **LAYOUTS[LAYOUT]), jax.devices())
    assert_matches(got[:2], one[:2])
    return None
