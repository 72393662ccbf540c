"""A small Llama run and its Hugging Face counterpart, for the HF import/export tests."""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from titanax.checkpoint.manager import Checkpointer
from titanax.config import CheckpointConfig, apply_overrides, load_config
from titanax.parallel.mesh import single_device_mesh
from titanax.parallel.rules import model_context
from titanax.train.optim import make_optimizer
from titanax.train.state import Role, create_train_state

ROOT = pathlib.Path(__file__).resolve().parents[2]


# GQA (4 query heads, 2 kv heads) and llama3 rope scaling whose original length (32) is inside
# the test sequences, so every frequency band (kept, blended, stretched) is exercised.
# init_std 0.2 makes logits O(1), so a 1e-4 agreement means something.
HF_SMALL = {"model.vocab_size": 384, "model.d_model": 64, "model.n_layers": 2,
            "model.n_heads": 4, "model.n_kv_heads": 2, "model.ffn_dim": 160, "model.max_seq_len": 64,
            "model.rope_theta": 10000.0, "model.rope_scaling": "llama3", "model.rope_factor": 8.0,
            "model.rope_original_max_seq_len": 32, "model.norm_eps": 1e-5, "execution.init_std": 0.2,
            "execution.dtype": "float32", "model.param_dtype": "float32",
            "execution.matmul_precision": "highest", "train.seq_len": 32, "train.batch_size": 4,
            "train.eval_batches": 1, "train.progress_bar": False, "data.source": "synthetic",
            "mesh.data": 1, "checkpoint.async_save": False}


HF_CONFIG = {"vocab_size": 384, "hidden_size": 64, "intermediate_size": 160,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 64,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
             "initializer_range": 0.2, "tie_word_embeddings": False,
             "bos_token_id": 0, "eos_token_id": 1}


TEXT = "def main():\n    return sorted(range(10))\n"


def hf_small_config(**extra):
    return apply_overrides(load_config(ROOT / "configs" / "tiny.py"), {**HF_SMALL, **extra})


def params_by_path(params) -> dict[tuple[str, ...], np.ndarray]:
    out = {}
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in keypath)
        out[tuple(k for k in keys if k != "value")] = np.asarray(leaf)
    return out


def make_run(workdir: pathlib.Path, cfg):
    """A titanax run folder with one checkpoint (norm scales randomised so their mapping is
    tested; a LoRA config's B factors too, so its adapters change the model) and a small BPE
    tokenizer; returns the parameters as numpy by path."""
    from titanax.data.tokenizer import train_bpe

    mesh = single_device_mesh()
    graphdef, state, _ = create_train_state(cfg, mesh, make_optimizer(cfg))
    rng = np.random.default_rng(1)

    def randomise(keypath, x):
        names = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in keypath)
        return x + 0.2 * rng.standard_normal(x.shape).astype(x.dtype) if "norm" in names else x

    state = state.with_group(state.weights_role, jax.tree_util.tree_map_with_path(
        randomise, state.weights))
    if state.adapters is not None:  # B starts at zero: make the adapters add something
        state = state.with_group(Role.ADAPTER, jax.tree_util.tree_map_with_path(
            lambda kp, x: x + 0.2 * rng.standard_normal(x.shape).astype(x.dtype)
            if "lora_b" in str(kp) else x, state.adapters))
    ckpt = Checkpointer(workdir / "checkpoints", CheckpointConfig(async_save=False))
    ckpt.save(0, state.to_saved(), data_state=None, config=cfg.to_dict())
    ckpt.close()
    docs = [TEXT * 3, "import os\nprint(os.getcwd())\n" * 5, "class A:\n    pass\n" * 4]
    train_bpe(docs, 300, workdir / "tokenizer.json")
    return params_by_path(state.weights)


def titanax_logits(cfg, graphdef, params, tokens) -> np.ndarray:
    with model_context(single_device_mesh()):
        logits, _ = nnx.merge(graphdef, params)(jnp.asarray(tokens))
    return np.asarray(logits)


def load_run(workdir):
    from titanax.generate import load_for_inference

    cfg, graphdef, params, _ = load_for_inference(workdir)
    return cfg, graphdef, params
