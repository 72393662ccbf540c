"""Mixtral dimensions (the published config.json of mistralai/Mixtral-8x7B-v0.1): 32,000
tokens, RoPE theta 1e6, RMSNorm eps 1e-5, 8 experts of 14,336, 2 per token, untied output
layer. Parameter counts from model_spec('mixtral').count_params (tests/test_moe_model.py):
mixtral_8x7b 46,702,792,704 (Mistral AI's 46.7 B), 12,879,925,248 active per token."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # CPU tests: GQA 4:2, 4 experts, 2 per token.
    "mixtral_tiny": dict(arch="mixtral", vocab_size=384, d_model=64, n_layers=2, n_heads=4,
                         n_kv_heads=2, ffn_dim=96, n_experts=4, experts_per_token=2,
                         rope_theta=1000000.0, rope_scaling="none", max_seq_len=256,
                         norm_eps=1e-5),
    "mixtral_8x7b": dict(arch="mixtral", vocab_size=32000, d_model=4096, n_layers=32,
                         n_heads=32, n_kv_heads=8, ffn_dim=14336, n_experts=8,
                         experts_per_token=2, rope_theta=1000000.0, rope_scaling="none",
                         max_seq_len=32768, norm_eps=1e-5, router_aux_loss_coef=0.02),
}
