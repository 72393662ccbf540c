"""Hugging Face Llama (LlamaForCausalLM) <-> titanax: the common decoder's tensor table
(models/common/hf_table.py) and Llama's config.json, with llama3 RoPE scaling, both
directions."""

from __future__ import annotations

from titanax.config import ModelConfig
from titanax.models.common.hf_config import common_config, common_overrides
from titanax.models.common.hf_interop import HFInterop, HFTensor
from titanax.models.common.hf_table import decoder_table, per_layer_rows


def tensor_table(cfg: ModelConfig) -> list[HFTensor]:
    """Every HF tensor of a LlamaForCausalLM with cfg's dimensions."""
    return decoder_table(cfg, per_layer_rows(cfg))


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


def model_overrides(hf: dict) -> dict[str, object]:
    """The model.* config values a Llama config.json implies, keyed like --set overrides."""
    if hf.get("model_type") not in (None, "llama"):
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'llama'")
    return common_overrides(hf, "Llama")


HF = HFInterop(model_type="llama", tensor_table=tensor_table, to_config=hf_config,
               from_config=model_overrides)
