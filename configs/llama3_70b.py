"""Llama 3 70B (preset dimensions), bf16 compute, FSDP over all devices; see titanax.recipes."""

from titanax.recipes import llama3_gpu_config


def config():
    return llama3_gpu_config("llama3_70b", batch_size=256, lr=1.5e-4)
