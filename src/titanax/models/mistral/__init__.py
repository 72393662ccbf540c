"""Mistral-7B-style dense (v0.1 .. v0.3 without sliding window): model.py (the common decoder
as it is), hf.py (MistralForCausalLM's config.json; sliding window refused), presets.py."""

from titanax.models.common.decoder import init_cache
from titanax.models.mistral.hf import HF
from titanax.models.mistral.model import Mistral
from titanax.models.mistral.presets import PRESETS
from titanax.models.spec import ModelSpec

SPEC = ModelSpec(arch="mistral", build=Mistral, init_cache=init_cache, presets=PRESETS, hf=HF)
