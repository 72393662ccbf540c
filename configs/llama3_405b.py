"""Llama 3 405B (preset dimensions), bf16 compute, FSDP over all devices; see titanax.recipes."""

from titanax.recipes import llama3_gpu_config


def config():
    return llama3_gpu_config("llama3_405b", batch_size=512, lr=8e-5)
