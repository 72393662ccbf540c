"""Mistral-7B-style dense (v0.1 .. v0.3 without sliding window): model.py (the common decoder
as it is), hf.py (MistralForCausalLM's config.json; sliding window refused), presets.py.

config.py the model section's class (MistralConfig) and spec.py the ModelSpec; this package
imports nothing, so the config can read config.py without loading jax."""
