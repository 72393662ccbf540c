"""What the transformers-side peers (tests/hf_peer/*_peer.py, each run under .venv-torch as
`python NAME_peer.py JOBS.json`, which puts this folder on sys.path) share: a float32 model
loaded or made at random, its logits, and the loop over the job list."""

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def load(folder):
    """The HF folder's causal LM, float32, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logits_of(model, tokens):
    """The model's float32 logits as numpy; tokens: an int tensor or the path of a .npy."""
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.from_numpy(np.load(tokens).astype(np.int64))
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().numpy()


def random_model(build, config, seed: int):
    """build(config) seeded with seed, float32, eval mode, its norm weights drawn around 1
    (they start at 1, which would hide a mapping that drops or swaps them)."""
    torch.manual_seed(seed)
    model = build(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def run_jobs(handlers) -> None:
    """Runs every job of the JSON list sys.argv[1] names on two threads: handlers[job['op']]
    for a dict of handlers, else handlers itself."""
    torch.set_num_threads(2)
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        (handlers[job["op"]] if isinstance(handlers, dict) else handlers)(job)
