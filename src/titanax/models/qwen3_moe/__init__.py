"""Qwen3 mixture of experts (Qwen3-30B-A3B, Qwen3-235B-A22B): model.py (Qwen3's attention with
per-head q/k norms, the MoE feed-forward of models/common/moe_block.py in every layer),
presets.py. Hugging Face import/export and expert parallelism: issue 37, not yet.

config.py the model section's class (Qwen3MoeConfig) and spec.py the ModelSpec; this package
imports nothing, so the config can read config.py without loading jax."""
