"""Llama 3 (and 3.1 / 3.2 / 3.3): model.py the Flax model, sharding.py its logical-axis table,
hf.py its Hugging Face tensor table and config.json, presets.py its published dimensions."""

from titanax.models.decoder import init_cache
from titanax.models.llama3.hf import HF
from titanax.models.llama3.model import Llama
from titanax.models.llama3.presets import PRESETS
from titanax.models.spec import ModelSpec

SPEC = ModelSpec(arch="llama3", build=Llama, init_cache=init_cache, presets=PRESETS, hf=HF)
