"""transformers' side of the Qwen3 interop tests (tests/test_qwen3.py), run under .venv-torch
as one subprocess: `python qwen3_peer.py JOBS.json`; float32 throughout.

Jobs:
  {"op": "logits", "dir": HF_DIR, "tokens": T.npy, "out": L.npy}
      loads HF_DIR with AutoModelForCausalLM and saves the logits of the tokens.
  {"op": "make", "dir": HF_DIR, "config": {Qwen3Config kwargs}, "seed": N, "tokens": T.npy,
   "out": L.npy}
      creates a random Qwen3ForCausalLM (norm weights, q_norm/k_norm included, randomised so
      their mapping is tested), saves it with save_pretrained and saves its logits.
"""

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM


def logits_of(model, tokens_path):
    tokens = torch.from_numpy(np.load(tokens_path).astype(np.int64))
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().numpy()


def job_logits(job):
    model = AutoModelForCausalLM.from_pretrained(job["dir"], dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM", type(model)
    np.save(job["out"], logits_of(model, job["tokens"]))


def job_make(job):
    torch.manual_seed(job["seed"])
    model = Qwen3ForCausalLM(Qwen3Config(**job["config"])).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(job["dir"], safe_serialization=True)
    np.save(job["out"], logits_of(model, job["tokens"]))


def main():
    torch.set_num_threads(2)
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    for job in jobs:
        {"logits": job_logits, "make": job_make}[job["op"]](job)


if __name__ == "__main__":
    main()
