"""The CPU default: a 5M-parameter Llama 3 on the embedded corpus (the Python standard library's
sources), 300 steps in a few minutes on 2 cores."""

from titanax.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    ExecutionConfig,
    OptimConfig,
    TrainConfig,
)
from titanax.models import preset


def config() -> Config:
    return Config(
        model=preset("tiny"),
        execution=ExecutionConfig(dtype="float32"),  # CPUs have no fast bf16 matmul
        train=TrainConfig(steps=300, batch_size=16, seq_len=256, log_every=10, eval_every=50),
        optim=OptimConfig(lr=3e-3, warmup_steps=30),
        data=DataConfig(source="embedded"),
        checkpoint=CheckpointConfig(every_steps=100, keep=3),
    )
