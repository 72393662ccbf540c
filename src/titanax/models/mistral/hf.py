"""Hugging Face Mistral (MistralForCausalLM) <-> titanax: the common decoder's tensor table
(models/common/hf_table.py) and Mistral's config.json.

Sliding-window attention is not implemented: a config.json whose sliding_window is set below
max_position_embeddings (Mistral-7B-v0.1: 4096 of 32768) is refused on import; a window at
least that long attends to everything a position can see, as v0.2+'s null does. It is kept as
model.sliding_window (models/mistral/config.py) and written back on export."""

from __future__ import annotations

from titanax.config import ModelConfig
from titanax.models.common.hf_config import (
    common_config,
    common_overrides,
    plain_rope_config,
    refuse_short_sliding_window,
)
from titanax.models.common.hf_interop import HFInterop, HFTensor
from titanax.models.common.hf_table import decoder_table, per_layer_rows


def tensor_table(cfg: ModelConfig) -> list[HFTensor]:
    """Every HF tensor of a MistralForCausalLM with cfg's dimensions."""
    return decoder_table(cfg, per_layer_rows(cfg))


def hf_config(cfg: ModelConfig, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json for transformers' MistralForCausalLM (and vLLM): full attention."""
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
            **common_config(cfg, dtype=dtype, bos_id=bos_id, eos_id=eos_id),
            **plain_rope_config(cfg, "Mistral"),
            "sliding_window": getattr(cfg, "sliding_window", 0) or None}


def model_overrides(hf: dict) -> dict[str, object]:
    """The model.* config values a Mistral config.json implies, keyed like --set overrides."""
    if hf.get("model_type") != "mistral":
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'mistral'")
    window = refuse_short_sliding_window(hf, "Mistral")
    return {**common_overrides(hf, "Mistral"), "model.sliding_window": window or 0}


HF = HFInterop(model_type="mistral", tensor_table=tensor_table, to_config=hf_config,
               from_config=model_overrides)
