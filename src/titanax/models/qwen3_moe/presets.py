"""Qwen3-MoE dimensions (the published config.json files of Qwen/Qwen3-30B-A3B and
Qwen/Qwen3-235B-A22B): 151,936 tokens, head_dim 128, RoPE theta 1e6, RMSNorm eps 1e-6, 128
experts, 8 per token, renormalised, untied output layer, router_aux_loss_coef 0.001. Parameter
counts from model_spec('qwen3_moe').count_params (tests/test_moe_model.py): qwen3_30b_a3b
30,532,122,624 total, 3,353,032,704 active; qwen3_235b_a22b 235,093,634,560 total,
22,190,763,520 active (Qwen's 30.5 B / 3.3 B and 235 B / 22 B)."""

from __future__ import annotations

_COMMON = dict(arch="qwen3_moe", vocab_size=151936, head_dim=128, rope_theta=1000000.0,
               rope_scaling="none", norm_eps=1e-6, max_seq_len=40960, n_experts=128,
               experts_per_token=8, norm_topk_prob=True, router_aux_loss_coef=0.001)

PRESETS: dict[str, dict] = {
    # CPU tests: GQA 4:2, head_dim (16) * heads != d_model, 8 experts, 2 per token.
    "qwen3_moe_tiny": dict(_COMMON, vocab_size=384, d_model=64, n_layers=2, n_heads=4,
                           n_kv_heads=2, head_dim=16, ffn_dim=48, n_experts=8,
                           experts_per_token=2, max_seq_len=256),
    "qwen3_30b_a3b": dict(_COMMON, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          ffn_dim=768),
    "qwen3_235b_a22b": dict(_COMMON, d_model=4096, n_layers=94, n_heads=64, n_kv_heads=4,
                            ffn_dim=1536),
}
