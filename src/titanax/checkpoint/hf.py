"""Hugging Face Llama <-> titanax: the tensor name table, per-tensor layout transforms (both
directions) and config.json, in one place.

Layouts. HF stores every projection as a torch Linear weight [out_features, in_features];
titanax keeps the head structure and stacks layers:

  HF name (layer i)                          HF shape         titanax parameter      per-layer shape
  model.embed_tokens.weight                  [V, d]           embed                  [V, d]
  model.layers.i.input_layernorm.weight      [d]              layers.attn_norm.scale [d]
  model.layers.i.self_attn.q_proj.weight     [Hq*hd, d]       layers.wq              [d, Hq, hd]
  model.layers.i.self_attn.k_proj.weight     [Hkv*hd, d]      layers.wk              [d, Hkv, hd]
  model.layers.i.self_attn.v_proj.weight     [Hkv*hd, d]      layers.wv              [d, Hkv, hd]
  model.layers.i.self_attn.o_proj.weight     [d, Hq*hd]       layers.wo              [d, Hq, hd]
  model.layers.i.post_attention_layernorm.weight [d]          layers.mlp_norm.scale  [d]
  model.layers.i.mlp.gate_proj.weight        [F, d]           layers.w_gate          [d, F]
  model.layers.i.mlp.up_proj.weight          [F, d]           layers.w_up            [d, F]
  model.layers.i.mlp.down_proj.weight        [d, F]           layers.w_down          [d, F]
  model.norm.weight                          [d]              final_norm.scale       [d]
  lm_head.weight                             [V, d]           output                 [d, V]

wo and w_down are stored [out, in] like HF (embed first, so FSDP gathers each layer's slice
along its major axis): o_proj is a reshape and down_proj a plain copy. (Checkpoints written
before that stored them [Hq, hd, d] and [F, d]; checkpoint/orbax_io.py converts them on load.)

RoPE needs no permutation: titanax rotates pairs (i, i + hd/2) ("rotate half"), the layout of
HF Llama checkpoints (Meta's original checkpoints interleave pairs and HF's conversion script
permutes q/k into this layout). tests/test_hf.py proves it against transformers' logits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from titanax.config import ModelConfig

PARAM_KEYS = ("embed", "final_norm", "layers", "output")  # top level of the params tree


@dataclasses.dataclass(frozen=True)
class HFTensor:
    name: str  # HF state-dict key
    param: tuple[str, ...]  # titanax parameter path, e.g. ('layers', 'wq')
    layer: int | None  # index into the stacked [L, ...] parameter; None: not stacked
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]  # titanax shape of this tensor (one layer's slice when stacked)
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray], np.ndarray]


def _identity(x):
    return x


def _transpose(x):
    return x.T


def _heads_in(shape):  # [d, H, hd] <-> [H*hd, d]
    d = shape[0]
    return (lambda x: x.reshape(d, -1).T), (lambda y: y.T.reshape(shape))


def _heads_out(shape):  # [d, H, hd] <-> [d, H*hd]
    d = shape[0]
    return (lambda x: x.reshape(d, -1)), (lambda y: y.reshape(shape))


def _entry(name, param, layer, shape, kind) -> HFTensor:
    if kind == "copy":
        to_hf = from_hf = _identity
        hf_shape = shape
    elif kind == "transpose":
        to_hf = from_hf = _transpose
        hf_shape = shape[::-1]
    elif kind == "heads_in":
        to_hf, from_hf = _heads_in(shape)
        hf_shape = (shape[1] * shape[2], shape[0])
    else:  # heads_out
        to_hf, from_hf = _heads_out(shape)
        hf_shape = (shape[0], shape[1] * shape[2])
    return HFTensor(name, param, layer, tuple(hf_shape), tuple(shape), to_hf, from_hf)


def tensor_table(cfg: ModelConfig) -> list[HFTensor]:
    """Every HF tensor of a LlamaForCausalLM with cfg's dimensions, in the order export writes
    them: all layers of one parameter before the next, so a stacked [L, ...] parameter is read
    from the checkpoint in a few large slices rather than once per layer."""
    d, V, F, hd = cfg.d_model, cfg.vocab_size, cfg.ffn_dim, cfg.resolved_head_dim
    Hq, Hkv = cfg.n_heads, cfg.n_kv_heads
    per_layer = [  # (HF suffix, titanax path, per-layer shape, transform)
        ("input_layernorm.weight", ("layers", "attn_norm", "scale"), (d,), "copy"),
        ("self_attn.q_proj.weight", ("layers", "wq"), (d, Hq, hd), "heads_in"),
        ("self_attn.k_proj.weight", ("layers", "wk"), (d, Hkv, hd), "heads_in"),
        ("self_attn.v_proj.weight", ("layers", "wv"), (d, Hkv, hd), "heads_in"),
        ("self_attn.o_proj.weight", ("layers", "wo"), (d, Hq, hd), "heads_out"),
        ("post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), (d,), "copy"),
        ("mlp.gate_proj.weight", ("layers", "w_gate"), (d, F), "transpose"),
        ("mlp.up_proj.weight", ("layers", "w_up"), (d, F), "transpose"),
        ("mlp.down_proj.weight", ("layers", "w_down"), (d, F), "copy"),
    ]
    table = [_entry("model.embed_tokens.weight", ("embed",), None, (V, d), "copy")]
    for suffix, param, shape, kind in per_layer:
        table += [_entry(f"model.layers.{i}.{suffix}", param, i, shape, kind)
                  for i in range(cfg.n_layers)]
    table.append(_entry("model.norm.weight", ("final_norm", "scale"), None, (d,), "copy"))
    table.append(_entry("lm_head.weight", ("output",), None, (d, V), "transpose"))
    return table


# --- config.json -----------------------------------------------------------------------------

def hf_config(cfg: ModelConfig, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json for transformers' LlamaForCausalLM (and vLLM, TGI, llama.cpp converters).

    RoPE is written both the way transformers 4.x / vLLM read it (rope_theta + rope_scaling)
    and the way transformers 5 writes it (rope_parameters); transformers 5 reads either."""
    rope_scaling = None
    if cfg.rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_factor,
                        "low_freq_factor": cfg.rope_low_freq_factor,
                        "high_freq_factor": cfg.rope_high_freq_factor,
                        "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    rope_parameters = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.resolved_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": cfg.init_std,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def _rope_of(hf: dict) -> tuple[float | None, dict | None]:
    """(rope_theta, scaling dict or None) from either the legacy or the transformers 5 keys."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params or None
    theta = hf.get("rope_theta", params.get("rope_theta"))
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return theta, scaling


def model_overrides(hf: dict) -> dict[str, object]:
    """The model.* config values an HF config.json implies, keyed like --set overrides."""
    if hf.get("model_type") not in (None, "llama"):
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'llama'; only "
                         "Llama-architecture checkpoints (LlamaForCausalLM) can be imported")
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if key in hf and hf[key] != ok:
            raise ValueError(f"config.json: {key}={hf[key]!r}; titanax's Llama has {key}={ok!r}")
    heads = hf["num_attention_heads"]
    out = {"model.vocab_size": hf["vocab_size"], "model.d_model": hf["hidden_size"],
           "model.n_layers": hf["num_hidden_layers"], "model.n_heads": heads,
           "model.n_kv_heads": hf.get("num_key_value_heads") or heads,
           "model.head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
           "model.ffn_dim": hf["intermediate_size"]}
    if "rms_norm_eps" in hf:
        out["model.norm_eps"] = hf["rms_norm_eps"]
    theta, scaling = _rope_of(hf)
    if theta is not None:
        out["model.rope_theta"] = float(theta)
    if scaling is None:
        out["model.rope_scaling"] = "none"
    else:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ValueError(f"config.json: rope scaling type {kind!r} is not supported (titanax "
                             "implements 'llama3' scaling or none)")
        out.update({"model.rope_scaling": "llama3", "model.rope_factor": scaling["factor"],
                    "model.rope_low_freq_factor": scaling["low_freq_factor"],
                    "model.rope_high_freq_factor": scaling["high_freq_factor"],
                    "model.rope_original_max_seq_len":
                        scaling["original_max_position_embeddings"]})
    return out


def config_mismatches(hf: dict, cfg: ModelConfig) -> list[str]:
    """'model.field=ours but config.json says theirs' for every field that disagrees."""
    problems = []
    for key, theirs in model_overrides(hf).items():
        field = key.split(".", 1)[1]
        ours = cfg.resolved_head_dim if field == "head_dim" else getattr(cfg, field)
        if cfg.rope_scaling == "none" and field.startswith("rope_") and field not in (
                "rope_theta", "rope_scaling"):
            continue  # scaling parameters mean nothing without scaling
        same = (math.isclose(float(ours), float(theirs), rel_tol=1e-6)
                if isinstance(theirs, float) or isinstance(ours, float) else ours == theirs)
        if not same:
            problems.append(f"{key}={ours!r} but config.json says {theirs!r} "
                            f"(--set {key}={theirs})")
    return problems
