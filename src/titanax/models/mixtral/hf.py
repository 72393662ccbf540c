"""Hugging Face Mixtral (MixtralForCausalLM) <-> titanax: the common layer's attention rows and
the hub's per-expert block_sparse_moe tensors (models/common/hf_table.py), and Mixtral's
config.json.

Mixtral always renormalises the top-k weights: a config with model.norm_topk_prob false has no
Mixtral config.json and is refused on export. Sliding-window attention and router jitter are
not implemented: a config.json with a window below max_position_embeddings or a nonzero
router_jitter_noise is refused on import; export writes sliding_window null."""

from __future__ import annotations

from titanax.config import ModelConfig
from titanax.models.common.hf_config import (
    common_config,
    common_overrides,
    moe_config,
    moe_overrides,
    plain_rope_config,
    refuse_short_sliding_window,
)
from titanax.models.common.hf_interop import HFInterop, HFTensor
from titanax.models.common.hf_table import attention_rows, decoder_table, moe_rows


def tensor_table(cfg: ModelConfig) -> list[HFTensor]:
    """Every HF tensor of a MixtralForCausalLM with cfg's dimensions (w1 gate, w3 up, w2 down)."""
    return decoder_table(cfg, attention_rows(cfg)
                         + moe_rows(cfg, "block_sparse_moe", "w1", "w3", "w2"))


def hf_config(cfg: ModelConfig, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json for transformers' MixtralForCausalLM (and vLLM): full attention."""
    if not cfg.norm_topk_prob:
        raise ValueError("model.norm_topk_prob=False: Mixtral always renormalises the top-k "
                         "router weights (set model.norm_topk_prob=true)")
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            **common_config(cfg, dtype=dtype, bos_id=bos_id, eos_id=eos_id),
            **plain_rope_config(cfg, "Mixtral"), **moe_config(cfg),
            "num_local_experts": cfg.n_experts, "router_jitter_noise": 0.0,
            "sliding_window": None}


def model_overrides(hf: dict) -> dict[str, object]:
    """The model.* config values a Mixtral config.json implies, keyed like --set overrides."""
    if hf.get("model_type") != "mixtral":
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'mixtral'")
    refuse_short_sliding_window(hf, "Mixtral")
    if hf.get("router_jitter_noise"):
        raise ValueError(f"config.json: router_jitter_noise={hf['router_jitter_noise']} is not "
                         "supported; titanax's router adds no noise (router_jitter_noise 0)")
    return {**common_overrides(hf, "Mixtral"), **moe_overrides(hf, hf["num_local_experts"]),
            "model.norm_topk_prob": True}


HF = HFInterop(model_type="mixtral", tensor_table=tensor_table, to_config=hf_config,
               from_config=model_overrides)
