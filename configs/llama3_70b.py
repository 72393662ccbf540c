"""Llama 3 70B (preset dimensions), bf16 compute, FSDP over all devices; see titanax.recipes.

train.grad_accum=auto: the memory check before the first step takes the fewest microbatches
(or the remat policy, or the layer loop's buffering) that fit the GPUs it runs on, so the
preset fits every cluster its docs name: 64x H100 (2), one 8x B200 node (32; 2 at batch 16)
(tests/test_plan_presets.py, docs/planner.md). --set train.grad_accum=N pins a count."""

from titanax.config import apply_overrides
from titanax.recipes import llama3_gpu_config


def config():
    return apply_overrides(llama3_gpu_config("llama3_70b", batch_size=256, lr=1.5e-4),
                           {"train.grad_accum": "auto"})
