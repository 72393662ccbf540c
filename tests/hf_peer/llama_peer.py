"""transformers' side of the HF interop tests, run under the PyTorch venv (.venv-torch) as one
subprocess: `python llama_peer.py JOBS.json`. Jobs exchange .npy and safetensors files with the
JAX test through a temp folder; everything is float32.

Jobs:
  {"op": "logits", "dir": HF_DIR, "tokens": T.npy, "out": L.npy, "text": TEXT?, "tok_out": J.json?}
      loads HF_DIR with AutoModelForCausalLM (and AutoTokenizer when "text" is given) and saves
      the logits of the tokens (and the tokenizer's ids for the text, plus its special tokens).
  {"op": "make", "dir": HF_DIR, "config": {LlamaConfig kwargs}, "seed": N, "tokens": T.npy, "out": L.npy}
      creates a random LlamaForCausalLM, saves it with save_pretrained (safetensors) and saves
      its logits on the tokens.
"""

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM


def logits_of(model, tokens_path):
    tokens = torch.from_numpy(np.load(tokens_path).astype(np.int64))
    with torch.no_grad():
        return model(input_ids=tokens).logits.float().numpy()


def job_logits(job):
    model = AutoModelForCausalLM.from_pretrained(job["dir"], dtype=torch.float32).eval()
    np.save(job["out"], logits_of(model, job["tokens"]))
    if "text" in job:
        tok = AutoTokenizer.from_pretrained(job["dir"])
        info = {"ids": tok(job["text"], add_special_tokens=False)["input_ids"],
                "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "config_bos": model.config.bos_token_id, "config_eos": model.config.eos_token_id,
                "rope": dict(model.config.rope_parameters)}
        with open(job["tok_out"], "w") as f:
            json.dump(info, f)


def job_make(job):
    torch.manual_seed(job["seed"])
    config = LlamaConfig(**job["config"])
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # norm weights start at 1: randomise them so their mapping is tested
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
