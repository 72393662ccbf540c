"""Whole-run recipes that configs/*.py build on (the dimensions come from the presets of models/*/presets.py)."""

from __future__ import annotations

from titanax.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    ExecutionConfig,
    MeshConfig,
    OptimConfig,
    TrainConfig,
)
from titanax.models import preset


def llama3_gpu_config(name: str, *, batch_size: int, lr: float) -> Config:
    """A Llama 3 preset for GPU clusters: bf16 compute over fp32 master weights with full
    remat (the layout MaxText and TorchTitan use at these sizes), FSDP over all devices.
    Attention 'auto': cuDNN's causal kernel without packed documents, our kernels (which skip
    other documents' tiles) with them; resolve.py logs which and why."""
    return Config(
        model=preset(name, param_dtype="float32"),
        execution=ExecutionConfig(dtype="bfloat16", remat="full", attention_impl="auto"),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1, pipeline=1),
        train=TrainConfig(steps=1000, batch_size=batch_size, seq_len=8192, log_every=10,
                          eval_every=500, eval_batches=4),
        optim=OptimConfig(lr=lr, warmup_steps=200, min_lr_ratio=0.1, weight_decay=0.1),
        # Point data.source at a folder written by `python -m launch.prepare_data`; random
        # tokens keep the preset runnable for benchmarks without a dataset.
        data=DataConfig(source="synthetic"),
        checkpoint=CheckpointConfig(every_steps=500, keep=3),
    )
