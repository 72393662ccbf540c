"""Qwen3 dense: model.py (the common block with per-head q/k norms), hf.py,
presets.py (0.6B to 32B and a tiny one for CPU tests).

config.py the model section's class (Qwen3Config) and spec.py the ModelSpec; this package
imports nothing, so the config can read config.py without loading jax."""
