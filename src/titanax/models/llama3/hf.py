"""Hugging Face Llama <-> titanax: the tensor name table and config.json, both directions.

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
  lm_head.weight (untied only)               [V, d]           output                 [d, V]

wo and w_down are stored [out, in] like HF (embed first, so FSDP gathers each layer's slice
along its major axis): o_proj is a reshape and down_proj a plain copy. (Checkpoints written
before that stored them [Hq, hd, d] and [F, d]; checkpoint/orbax_io.py converts them on load.)
With model.tie_embeddings there is no lm_head: HF ties it to embed_tokens as titanax does.

RoPE needs no permutation: titanax rotates pairs (i, i + hd/2) ("rotate half"), the layout of
HF Llama checkpoints (Meta's original checkpoints interleave pairs and HF's conversion script
permutes q/k into this layout). tests/test_hf.py proves it against transformers' logits.
"""

from __future__ import annotations

from titanax.config import ModelConfig
from titanax.models.hf_interop import HFInterop, HFTensor, entry


def per_layer_rows(cfg: ModelConfig) -> list[tuple]:
    """(HF suffix after model.layers.i., titanax path, per-layer shape, transform) of a Llama
    decoder layer; architectures built on Llama's block add their own rows."""
    d, F, hd = cfg.d_model, cfg.ffn_dim, cfg.resolved_head_dim
    Hq, Hkv = cfg.n_heads, cfg.n_kv_heads
    return [
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


def decoder_table(cfg: ModelConfig, rows: list[tuple]) -> list[HFTensor]:
    """Embedding, every layer's `rows`, final norm and (untied) lm_head, in the order export
    writes them: all layers of one parameter before the next, so a stacked [L, ...] parameter
    is read from the checkpoint in a few large slices rather than once per layer."""
    d, V = cfg.d_model, cfg.vocab_size
    table = [entry("model.embed_tokens.weight", ("embed",), None, (V, d), "copy")]
    for suffix, param, shape, kind in rows:
        table += [entry(f"model.layers.{i}.{suffix}", param, i, shape, kind)
                  for i in range(cfg.n_layers)]
    table.append(entry("model.norm.weight", ("final_norm", "scale"), None, (d,), "copy"))
    if not cfg.tie_embeddings:
        table.append(entry("lm_head.weight", ("output",), None, (d, V), "transpose"))
    return table


def tensor_table(cfg: ModelConfig) -> list[HFTensor]:
    """Every HF tensor of a LlamaForCausalLM with cfg's dimensions."""
    return decoder_table(cfg, per_layer_rows(cfg))


# --- config.json -----------------------------------------------------------------------------

def common_config(cfg: ModelConfig, *, dtype: str, bos_id, eos_id) -> dict:
    """The config.json keys every Llama-style decoder shares (dimensions, norms, tying)."""
    return {
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
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,  # transformers 4.x and vLLM read this one
        "dtype": dtype,  # transformers 5 writes (and prefers) this one
    }


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
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **common_config(cfg, dtype=dtype, bos_id=bos_id, eos_id=eos_id),
            "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters, "mlp_bias": False, "pretraining_tp": 1}


def _rope_of(hf: dict) -> tuple[float | None, dict | None]:
    """(rope_theta, scaling dict or None) from either the legacy or the transformers 5 keys."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params or None
    theta = hf.get("rope_theta", params.get("rope_theta"))
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return theta, scaling


def _rope_overrides(hf: dict) -> dict[str, object]:
    theta, scaling = _rope_of(hf)
    out = {} if theta is None else {"model.rope_theta": float(theta)}
    if scaling is None:
        return {**out, "model.rope_scaling": "none"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"config.json: rope scaling type {kind!r} is not supported (titanax "
                         "implements 'llama3' scaling or none)")
    return {**out, "model.rope_scaling": "llama3", "model.rope_factor": scaling["factor"],
            "model.rope_low_freq_factor": scaling["low_freq_factor"],
            "model.rope_high_freq_factor": scaling["high_freq_factor"],
            "model.rope_original_max_seq_len": scaling["original_max_position_embeddings"]}


def common_overrides(hf: dict, arch_name: str) -> dict[str, object]:
    """The model.* values (keyed like --set overrides) of a Llama-style config.json."""
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if key in hf and hf[key] != ok:
            raise ValueError(f"config.json: {key}={hf[key]!r}; titanax's {arch_name} has "
                             f"{key}={ok!r}")
    heads = hf["num_attention_heads"]
    out = {"model.vocab_size": hf["vocab_size"], "model.d_model": hf["hidden_size"],
           "model.n_layers": hf["num_hidden_layers"], "model.n_heads": heads,
           "model.n_kv_heads": hf.get("num_key_value_heads") or heads,
           "model.head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
           "model.ffn_dim": hf["intermediate_size"],
           "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
    if "rms_norm_eps" in hf:
        out["model.norm_eps"] = hf["rms_norm_eps"]
    return {**out, **_rope_overrides(hf)}


def model_overrides(hf: dict) -> dict[str, object]:
    """The model.* config values a Llama config.json implies, keyed like --set overrides."""
    if hf.get("model_type") not in (None, "llama"):
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'llama'")
    return common_overrides(hf, "Llama")


HF = HFInterop(model_type="llama", tensor_table=tensor_table, to_config=hf_config,
               from_config=model_overrides)
