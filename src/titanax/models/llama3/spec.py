"""The llama3 ModelSpec: what the rest of titanax asks of this architecture (models/spec.py),
registered under model.arch='llama3' in titanax/archs.py."""

from titanax.models.common.decoder import init_cache
from titanax.models.llama3.config import Llama3Config
from titanax.models.llama3.hf import HF
from titanax.models.llama3.migrations import legacy_transposes
from titanax.models.llama3.model import Llama
from titanax.models.llama3.presets import PRESETS
from titanax.models.spec import ModelSpec

SPEC = ModelSpec(arch="llama3", config=Llama3Config, build=Llama, init_cache=init_cache, presets=PRESETS, hf=HF,
                 legacy_transposes=legacy_transposes)
