"""The mistral ModelSpec: what the rest of titanax asks of this architecture (models/spec.py),
registered under model.arch='mistral' in titanax/archs.py."""

from titanax.models.common.decoder import init_cache
from titanax.models.mistral.config import MistralConfig
from titanax.models.mistral.hf import HF
from titanax.models.mistral.model import Mistral
from titanax.models.mistral.presets import PRESETS
from titanax.models.spec import ModelSpec

SPEC = ModelSpec(arch="mistral", config=MistralConfig, build=Mistral, init_cache=init_cache, presets=PRESETS, hf=HF)
