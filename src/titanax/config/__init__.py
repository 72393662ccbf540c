"""Typed, frozen run configuration: one dataclass per section, validated once.

A run is described by `Config` (sections model, execution, mesh, pipeline, train, optim, data,
checkpoint, lora): `model` is what the weights are (its class is the architecture's own, chosen by
model.arch), `execution` how they are computed (a resume may change it).
It comes from a Python file defining `config()` or a gin file binding the section names
(`model.d_model = 256`), then `--set section.field=value` overrides. Every check that needs no
devices happens here, before anything is compiled, and each error names the field and the fix.

One job per module: errors.py (ConfigError, per-field checks), one module per section
(model.py, execution.py, parallel.py for mesh and pipeline, train.py, optim.py, data.py, checkpoint.py,
lora.py), sizes.py and mixture.py (the two small text formats), rules.py (Config and its cross-section
checks), overrides.py (--set), loading.py (.py / .gin / config.json). This package imports
no jax: config errors print in a fraction of a second.
"""

from titanax.config.checkpoint import CheckpointConfig
from titanax.config.data import DataConfig
from titanax.config.errors import ConfigError
from titanax.config.execution import (
    ATTENTION_IMPLS,
    CONTEXT_STRATEGIES,
    DTYPES,
    GRAD_REDUCE_DTYPES,
    MATMUL_PRECISIONS,
    MXFP8_SCALE_ROUNDINGS,
    REMAT_POLICIES,
    ExecutionConfig,
)
from titanax.config.loading import format_config, load_config
from titanax.config.lora import LORA_TARGETS, LoraConfig
from titanax.config.mixture import SOURCE_UNSET, parse_source
from titanax.config.model import EXECUTION_FIELDS, ROPE_SCALINGS, ModelConfig
from titanax.config.optim import LR_SCHEDULES, OptimConfig
from titanax.config.overrides import apply_overrides, parse_override
from titanax.config.parallel import PIPELINE_SCHEDULES, MeshConfig, PipelineConfig
from titanax.config.rules import (
    SECTIONS,
    Config,
    check_parallel_layout,
    grad_accum_in_place_unsupported,
    tp_overlap_unsupported,
)
from titanax.config.sizes import parse_bytes
from titanax.config.train import GRAD_ACCUM_AUTO, TrainConfig

__all__ = [
    "ATTENTION_IMPLS", "CONTEXT_STRATEGIES", "DTYPES", "GRAD_ACCUM_AUTO", "GRAD_REDUCE_DTYPES",
    "LORA_TARGETS", "LR_SCHEDULES", "MATMUL_PRECISIONS", "MXFP8_SCALE_ROUNDINGS", "PIPELINE_SCHEDULES",
    "REMAT_POLICIES", "ROPE_SCALINGS", "SECTIONS", "SOURCE_UNSET", "CheckpointConfig", "Config",
    "ConfigError", "DataConfig", "EXECUTION_FIELDS", "ExecutionConfig", "LoraConfig", "MeshConfig", "ModelConfig", "OptimConfig", "PipelineConfig",
    "TrainConfig", "apply_overrides", "check_parallel_layout", "format_config",
    "grad_accum_in_place_unsupported", "load_config", "parse_bytes", "parse_override",
    "parse_source", "tp_overlap_unsupported",
]
