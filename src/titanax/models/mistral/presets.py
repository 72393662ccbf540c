"""Mistral dimensions (the published config.json of mistralai/Mistral-7B-v0.3): 32,768 tokens,
plain RoPE theta 1e6, RMSNorm eps 1e-5, untied output layer. Parameter count from
model_spec('mistral').count_params: mistral_7b 7,248,023,552 (tests/test_model_suite.py)."""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # CPU tests: GQA 4:2, head_dim (32) * heads != d_model, as Mistral's config allows.
    "mistral_tiny": dict(arch="mistral", vocab_size=384, d_model=64, n_layers=2, n_heads=4,
                         n_kv_heads=2, head_dim=32, ffn_dim=160, rope_theta=1000000.0,
                         rope_scaling="none", max_seq_len=256, norm_eps=1e-5),
    "mistral_7b": dict(arch="mistral", vocab_size=32768, d_model=4096, n_layers=32, n_heads=32,
                       n_kv_heads=8, head_dim=128, ffn_dim=14336, rope_theta=1000000.0,
                       rope_scaling="none", max_seq_len=32768, norm_eps=1e-5),
}
