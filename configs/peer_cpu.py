"""The model of docs/performance.md's side-by-side with the PyTorch peer
(../shared/bench/hf_torch_train.py defaults): hidden 512, 8 layers, 8 heads / 2 kv heads,
ffn 1536, vocab 32000, untied, batch 8 x seq 512, float32, AdamW."""

import dataclasses

from titanax.config import Config, DataConfig, ExecutionConfig, MeshConfig, OptimConfig, TrainConfig
from titanax.models import preset


def config() -> Config:
    model = dataclasses.replace(
        preset("tiny"), vocab_size=32000, d_model=512, n_layers=8, n_heads=8, n_kv_heads=2,
        ffn_dim=1536, rope_scaling="none", max_seq_len=2048,
        param_dtype="float32")
    return Config(
        model=model,
        execution=ExecutionConfig(dtype="float32"),
        mesh=MeshConfig(data=1),
        train=TrainConfig(steps=20, batch_size=8, seq_len=512, log_every=1, eval_every=0),
        optim=OptimConfig(lr=3e-4, warmup_steps=2, weight_decay=0.1),
        data=DataConfig(source="synthetic"),
    )
