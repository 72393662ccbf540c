"""transformers' side of the model suite (tests/helpers/model_suite.py), run under .venv-torch
as one subprocess for every architecture: `python model_peer.py JOBS.json`; float32 throughout.

Jobs:
  {"op": "logits", "dir": HF_DIR, "class": NAME, "tokens": T.npy, "out": L.npy}
      loads HF_DIR with AutoModelForCausalLM (it must be class NAME) and saves the logits.
  {"op": "make", "model_type": TYPE, "config": {config kwargs}, "seed": N, "dir": HF_DIR,
   "tokens": T.npy, "out": L.npy, "count_out": C.json}
      creates a random model of TYPE (norm weights randomised too, so their mapping is
      tested), saves it with save_pretrained, its logits and its parameter count (tied
      weights once).
  {"op": "greedy", "dir": HF_DIR, "ids": [..], "max_new_tokens": N, "out": G.json}
      greedy generation (do_sample=False, KV cache) of exactly N new ids after the prompt,
      no end-of-sequence stop.
"""

import json

import numpy as np
import torch
from peer_common import load, logits_of, random_model, run_jobs
from transformers import AutoConfig, AutoModelForCausalLM


def job_logits(job):
    model = load(job["dir"])
    assert type(model).__name__ == job["class"], type(model)
    np.save(job["out"], logits_of(model, job["tokens"]))


def job_make(job):
    config = AutoConfig.for_model(job["model_type"], **job["config"])
    model = random_model(AutoModelForCausalLM.from_config, config, job["seed"])
    model.save_pretrained(job["dir"], safe_serialization=True)
    np.save(job["out"], logits_of(model, job["tokens"]))
    with open(job["count_out"], "w") as f:
        json.dump(sum(p.numel() for p in model.parameters()), f)


def job_greedy(job):
    model = load(job["dir"])
    n = job["max_new_tokens"]
    with torch.no_grad():
        out = model.generate(torch.tensor([job["ids"]]), do_sample=False, max_new_tokens=n,
                             min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with open(job["out"], "w") as f:
        json.dump(out[0, len(job["ids"]):].tolist(), f)


if __name__ == "__main__":
    run_jobs({"logits": job_logits, "make": job_make, "greedy": job_greedy})
