"""Llama 3 8B (preset dimensions), bf16 compute, FSDP over all devices; see titanax.recipes.

train.grad_accum=auto: the memory check before the first step takes the fewest microbatches
(or the remat policy, or the layer loop's buffering) that fit the GPUs it runs on, so the
preset fits every cluster its docs name: 8x H100 (it takes grad_accum 4) and 8x B200 (1)
(tests/test_plan_presets.py, docs/planner.md). --set train.grad_accum=N pins a count."""

from titanax.config import apply_overrides
from titanax.recipes import llama3_gpu_config


def config():
    return apply_overrides(llama3_gpu_config("llama3_8b", batch_size=256, lr=3e-4),
                           {"train.grad_accum": "auto"})
