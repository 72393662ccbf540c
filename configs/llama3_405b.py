"""Llama 3 405B (preset dimensions), bf16 compute, FSDP over all devices; see titanax.recipes.

train.grad_accum=auto: the memory check before the first step takes the fewest microbatches
(or the remat policy, or the layer loop's buffering) that fit the GPUs it runs on, so the
preset fits every cluster its docs name: 256x H100 (32 nodes; 2)
(tests/test_plan_presets.py, docs/planner.md). --set train.grad_accum=N pins a count."""

from titanax.config import apply_overrides
from titanax.recipes import llama3_gpu_config


def config():
    return apply_overrides(llama3_gpu_config("llama3_405b", batch_size=512, lr=8e-5),
                           {"train.grad_accum": "auto"})
