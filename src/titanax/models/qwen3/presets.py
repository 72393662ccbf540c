"""Qwen3 dense dimensions (the published config.json files of Qwen/Qwen3-*): head_dim 128
whatever d_model, RoPE theta 1e6 without scaling, RMSNorm eps 1e-6, 151,936 tokens, embeddings
tied up to 4B. Parameter counts from model_spec('qwen3').count_params (tied embeddings once):
qwen3_0_6b 596,049,920; qwen3_8b 8,190,735,360 (tests/test_qwen3.py)."""

from __future__ import annotations

_COMMON = dict(arch="qwen3", vocab_size=151936, head_dim=128, n_kv_heads=8,
               rope_theta=1000000.0, rope_scaling="none", norm_eps=1e-6, max_seq_len=40960)

PRESETS: dict[str, dict] = {
    # CPU tests: GQA, head_dim (16) * heads != d_model, as in the real sizes.
    "qwen3_tiny": dict(_COMMON, vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=16, ffn_dim=160, max_seq_len=256, tie_embeddings=True),
    "qwen3_0_6b": dict(_COMMON, d_model=1024, n_layers=28, n_heads=16, ffn_dim=3072,
                       tie_embeddings=True),
    "qwen3_1_7b": dict(_COMMON, d_model=2048, n_layers=28, n_heads=16, ffn_dim=6144,
                       tie_embeddings=True),
    "qwen3_4b": dict(_COMMON, d_model=2560, n_layers=36, n_heads=32, ffn_dim=9728,
                     tie_embeddings=True),
    "qwen3_8b": dict(_COMMON, d_model=4096, n_layers=36, n_heads=32, ffn_dim=12288),
    "qwen3_14b": dict(_COMMON, d_model=5120, n_layers=40, n_heads=40, ffn_dim=17408),
    "qwen3_32b": dict(_COMMON, d_model=5120, n_layers=64, n_heads=64, ffn_dim=25600),
}
