"""Hugging Face Qwen3 (Qwen3ForCausalLM) <-> titanax: the common decoder's tensor table with the
per-head q/k norm rows (models/common/hf_table.py), and Qwen3's config.json.

Sliding-window attention (use_sliding_window) is not implemented: such a config.json is
refused on import, and export writes use_sliding_window false."""

from __future__ import annotations

from titanax.config import ModelConfig
from titanax.models.common.hf_config import (
    common_config,
    common_overrides,
    plain_rope_config,
    refuse_layer_sliding_window,
)
from titanax.models.common.hf_interop import HFInterop, HFTensor
from titanax.models.common.hf_table import decoder_table, per_layer_rows, qk_norm_rows


def tensor_table(cfg: ModelConfig) -> list[HFTensor]:
    """Every HF tensor of a Qwen3ForCausalLM with cfg's dimensions."""
    return decoder_table(cfg, per_layer_rows(cfg) + qk_norm_rows(cfg))


def hf_config(cfg: ModelConfig, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json for transformers' Qwen3ForCausalLM (and vLLM). RoPE as both the legacy
    rope_theta and transformers 5's rope_parameters."""
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            **common_config(cfg, dtype=dtype, bos_id=bos_id, eos_id=eos_id),
            **plain_rope_config(cfg, "Qwen3"),
            "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.n_layers}


def model_overrides(hf: dict) -> dict[str, object]:
    """The model.* config values a Qwen3 config.json implies, keyed like --set overrides."""
    if hf.get("model_type") != "qwen3":
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'qwen3'")
    refuse_layer_sliding_window(hf, "Qwen3")
    return common_overrides(hf, "Qwen3")


HF = HFInterop(model_type="qwen3", tensor_table=tensor_table, to_config=hf_config,
               from_config=model_overrides)
