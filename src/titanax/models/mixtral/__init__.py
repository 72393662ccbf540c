"""Mixtral-style mixture of experts (Mixtral-8x7B): model.py (the common attention with the MoE
feed-forward of models/common/moe_block.py), presets.py. Hugging Face import/export and expert
parallelism: issue 37, not yet.

config.py the model section's class (MixtralConfig) and spec.py the ModelSpec; this package
imports nothing, so the config can read config.py without loading jax."""
