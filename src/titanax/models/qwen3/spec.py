"""The qwen3 ModelSpec: what the rest of titanax asks of this architecture (models/spec.py),
registered under model.arch='qwen3' in titanax/archs.py."""

from titanax.models.common.decoder import init_cache
from titanax.models.qwen3.config import Qwen3Config
from titanax.models.qwen3.hf import HF
from titanax.models.qwen3.model import Qwen3
from titanax.models.qwen3.presets import PRESETS
from titanax.models.spec import ModelSpec

SPEC = ModelSpec(arch="qwen3", config=Qwen3Config, build=Qwen3, init_cache=init_cache, presets=PRESETS, hf=HF)
