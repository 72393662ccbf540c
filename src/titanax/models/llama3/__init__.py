"""Llama 3 (and 3.1 / 3.2 / 3.3): model.py the Flax model (the common decoder as it is), hf.py
its Hugging Face config.json, presets.py its published dimensions, migrations.py the layouts
older titanax checkpoints stored its parameters in."""

from titanax.models.common.decoder import init_cache
from titanax.models.llama3.hf import HF
from titanax.models.llama3.migrations import legacy_transposes
from titanax.models.llama3.model import Llama
from titanax.models.llama3.presets import PRESETS
from titanax.models.spec import ModelSpec

SPEC = ModelSpec(arch="llama3", build=Llama, init_cache=init_cache, presets=PRESETS, hf=HF,
                 legacy_transposes=legacy_transposes)
