"""Qwen3 dense: model.py (the common block with per-head q/k norms), hf.py,
presets.py (0.6B to 32B and a tiny one for CPU tests)."""

from titanax.models.common.decoder import init_cache
from titanax.models.qwen3.hf import HF
from titanax.models.qwen3.model import Qwen3
from titanax.models.qwen3.presets import PRESETS
from titanax.models.spec import ModelSpec

SPEC = ModelSpec(arch="qwen3", build=Qwen3, init_cache=init_cache, presets=PRESETS, hf=HF)
