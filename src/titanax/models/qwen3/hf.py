"""Hugging Face Qwen3 (Qwen3ForCausalLM) <-> titanax: Llama's table (models/llama3/hf.py) plus
the per-head norms, and Qwen3's config.json.

  HF name (layer i)                          HF shape   titanax parameter       per-layer shape
  model.layers.i.self_attn.q_norm.weight     [hd]       layers.q_norm.scale     [hd]
  model.layers.i.self_attn.k_norm.weight     [hd]       layers.k_norm.scale     [hd]

Sliding-window attention (use_sliding_window) is not implemented: such a config.json is
refused on import, and export writes use_sliding_window false."""

from __future__ import annotations

from titanax.config import ModelConfig
from titanax.models.hf_interop import HFInterop, HFTensor
from titanax.models.llama3.hf import common_config, common_overrides, decoder_table, per_layer_rows


def tensor_table(cfg: ModelConfig) -> list[HFTensor]:
    """Every HF tensor of a Qwen3ForCausalLM with cfg's dimensions."""
    hd = cfg.resolved_head_dim
    qk_norms = [("self_attn.q_norm.weight", ("layers", "q_norm", "scale"), (hd,), "copy"),
                ("self_attn.k_norm.weight", ("layers", "k_norm", "scale"), (hd,), "copy")]
    return decoder_table(cfg, per_layer_rows(cfg) + qk_norms)


def hf_config(cfg: ModelConfig, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json for transformers' Qwen3ForCausalLM (and vLLM). RoPE as both the legacy
    rope_theta and transformers 5's rope_parameters."""
    if cfg.rope_scaling != "none":
        raise ValueError(f"model.rope_scaling={cfg.rope_scaling!r}: Qwen3 exports plain RoPE "
                         "only (set model.rope_scaling=none)")
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            **common_config(cfg, dtype=dtype, bos_id=bos_id, eos_id=eos_id),
            "rope_theta": cfg.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.n_layers}


def model_overrides(hf: dict) -> dict[str, object]:
    """The model.* config values a Qwen3 config.json implies, keyed like --set overrides."""
    if hf.get("model_type") != "qwen3":
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'qwen3'")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if hf.get("use_sliding_window") or layer_types != {"full_attention"}:
        raise ValueError("config.json: sliding-window attention (use_sliding_window / "
                         "layer_types) is not supported; titanax's Qwen3 attends to the full "
                         "sequence")
    return common_overrides(hf, "Qwen3")


HF = HFInterop(model_type="qwen3", tensor_table=tensor_table, to_config=hf_config,
               from_config=model_overrides)
