"""Qwen3-30B-A3B (48 layers, 128 experts of which 8 per token; preset dimensions), bf16 compute
over fp32 master weights, FSDP over all devices; see titanax.recipes and docs/moe.md."""

from titanax.recipes import llama3_gpu_config


def config():
    return llama3_gpu_config("qwen3_30b_a3b", batch_size=256, lr=3e-4)
