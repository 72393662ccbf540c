"""The config.json keys every HF decoder built on the common block shares (Llama, Mistral,
Qwen3): dimensions, norms, tying and RoPE, both directions. Each architecture's hf.py adds its
model_type, architectures and own keys."""

from __future__ import annotations

from titanax.config import ExecutionConfig, ModelConfig


def common_config(cfg: ModelConfig, *, dtype: str, bos_id, eos_id) -> dict:
    """The config.json keys every decoder of the common block shares (dimensions, norms,
    tying)."""
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
        # Read by transformers only to initialise new weights; a run's own is execution.init_std.
        "initializer_range": ExecutionConfig().init_std,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,  # transformers 4.x and vLLM read this one
        "dtype": dtype,  # transformers 5 writes (and prefers) this one
    }


def plain_rope_config(cfg: ModelConfig, arch_name: str) -> dict:
    """RoPE keys of an architecture without scaling (Mistral, Qwen3): the legacy rope_theta
    and transformers 5's rope_parameters. Refuses a config with scaling, which such a
    config.json cannot express."""
    if cfg.rope_scaling != "none":
        raise ValueError(f"model.rope_scaling={cfg.rope_scaling!r}: {arch_name} exports plain "
                         "RoPE only (set model.rope_scaling=none)")
    return {"rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta}}


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
    """The model.* values (keyed like --set overrides) of a config.json of the common block."""
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


def moe_config(cfg: ModelConfig) -> dict:
    """The config.json keys Mixtral and Qwen3-MoE share (config/moe.py's fields). The router's
    logits are not returned: titanax adds the balancing loss itself, weighted the same."""
    return {"num_experts_per_tok": cfg.experts_per_token,
            "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False}


def moe_overrides(hf: dict, n_experts: int) -> dict[str, object]:
    """The MoE model.* values of a Mixtral or Qwen3-MoE config.json (n_experts: read by the
    caller, as the two name it differently)."""
    out = {"model.n_experts": n_experts, "model.experts_per_token": hf["num_experts_per_tok"]}
    if "router_aux_loss_coef" in hf:
        out["model.router_aux_loss_coef"] = float(hf["router_aux_loss_coef"])
    return out


def refuse_layer_sliding_window(hf: dict, name: str) -> None:
    """Qwen-style sliding-window attention (use_sliding_window / layer_types) is refused:
    titanax's `name` attends to the full sequence."""
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if hf.get("use_sliding_window") or layer_types != {"full_attention"}:
        raise ValueError("config.json: sliding-window attention (use_sliding_window / "
                         f"layer_types) is not supported; titanax's {name} attends to the full "
                         "sequence")


def refuse_short_sliding_window(hf: dict, name: str) -> int | None:
    """Mistral-style sliding_window: refused below max_position_embeddings (titanax's `name`
    attends to the whole prefix); returns it (None: no window)."""
    window, longest = hf.get("sliding_window"), hf.get("max_position_embeddings")
    if window is not None and (longest is None or window < longest):
        raise ValueError(f"config.json: sliding_window={window} (below max_position_embeddings="
                         f"{longest}) is not supported; titanax's {name} attends to the full "
                         "sequence (sliding_window null)")
    return window
