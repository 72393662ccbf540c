"""Llama 3 (and 3.1 / 3.2 / 3.3): model.py the Flax model (the common decoder as it is), hf.py
its Hugging Face config.json, presets.py its published dimensions, migrations.py the layouts
older titanax checkpoints stored its parameters in.

config.py the model section's class (Llama3Config) and spec.py the ModelSpec; this package
imports nothing, so the config can read config.py without loading jax."""
