"""Llama 3 dimensions, one table. Parameter counts (untied output layer) from
model_spec('llama3').count_params: llama3_8b 8,030,261,248; llama3_70b 70,553,706,496;
llama3_405b 405,853,388,800 (tested)."""

from __future__ import annotations

_LLAMA3_COMMON = dict(rope_theta=500000.0, rope_scaling="llama3", rope_factor=8.0,
                      rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                      rope_original_max_seq_len=8192, norm_eps=1e-5, vocab_size=128256,
                      max_seq_len=8192)

PRESETS: dict[str, dict] = {
    # CPU default: small enough to train 300 steps on 2 cores in a few minutes.
    "tiny": dict(vocab_size=4096, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4,
                 ffn_dim=768, rope_theta=500000.0, rope_scaling="llama3", max_seq_len=2048,
                 rope_original_max_seq_len=256, norm_eps=1e-5),
    "llama3_8b": dict(_LLAMA3_COMMON, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14336),
    "llama3_70b": dict(_LLAMA3_COMMON, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       ffn_dim=28672),
    "llama3_405b": dict(_LLAMA3_COMMON, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                        ffn_dim=53248),
}
