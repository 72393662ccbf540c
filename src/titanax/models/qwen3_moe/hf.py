"""Hugging Face Qwen3-MoE (Qwen3MoeForCausalLM) <-> titanax: the common layer's attention
rows with the per-head q/k norms and the hub's per-expert mlp tensors
(models/common/hf_table.py), and Qwen3-MoE's config.json.

Every layer is sparse in titanax: a config.json with dense layers (decoder_sparse_step other
than 1, or mlp_only_layers) or sliding-window attention is refused on import. model.ffn_dim is
each expert's width, moe_intermediate_size; export also writes it as intermediate_size, the
dense MLP width that no layer then uses, unless the run was imported: then the source's
intermediate_size is written back as it was (HFInterop.source_keeps)."""

from __future__ import annotations

from titanax.config import ModelConfig
from titanax.models.common.hf_config import (
    common_config,
    common_overrides,
    moe_config,
    moe_overrides,
    plain_rope_config,
    refuse_layer_sliding_window,
)
from titanax.models.common.hf_interop import HFInterop, HFTensor
from titanax.models.common.hf_table import attention_rows, decoder_table, moe_rows, qk_norm_rows


def tensor_table(cfg: ModelConfig) -> list[HFTensor]:
    """Every HF tensor of a Qwen3MoeForCausalLM with cfg's dimensions."""
    return decoder_table(cfg, attention_rows(cfg) + qk_norm_rows(cfg)
                         + moe_rows(cfg, "mlp", "gate_proj", "up_proj", "down_proj"))


def hf_config(cfg: ModelConfig, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json for transformers' Qwen3MoeForCausalLM (and vLLM): num_experts as the
    published checkpoints name it (transformers 5 maps it to num_local_experts)."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            **common_config(cfg, dtype=dtype, bos_id=bos_id, eos_id=eos_id),
            **plain_rope_config(cfg, "Qwen3-MoE"), **moe_config(cfg),
            "num_experts": cfg.n_experts, "moe_intermediate_size": cfg.ffn_dim,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.n_layers}


def model_overrides(hf: dict) -> dict[str, object]:
    """The model.* config values a Qwen3-MoE config.json implies, keyed like --set overrides."""
    if hf.get("model_type") != "qwen3_moe":
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'qwen3_moe'")
    refuse_layer_sliding_window(hf, "Qwen3-MoE")
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ValueError(f"config.json: decoder_sparse_step={hf.get('decoder_sparse_step', 1)}"
                         f", mlp_only_layers={hf.get('mlp_only_layers')} (dense layers) is not "
                         "supported; every titanax Qwen3-MoE layer is sparse (1 and [])")
    # transformers 5 saves num_experts as num_local_experts (its attribute_map).
    n_experts = hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"]
    return {**common_overrides(hf, "Qwen3-MoE"), **moe_overrides(hf, n_experts),
            "model.ffn_dim": hf["moe_intermediate_size"],
            # Qwen3MoeConfig's default when the key is absent.
            "model.norm_topk_prob": bool(hf.get("norm_topk_prob", False))}


HF = HFInterop(model_type="qwen3_moe", tensor_table=tensor_table, to_config=hf_config,
               from_config=model_overrides, source_keeps=("intermediate_size",))
