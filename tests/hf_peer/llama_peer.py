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

import numpy as np
from peer_common import load, logits_of, random_model, run_jobs
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM


def job_logits(job):
    model = load(job["dir"])
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
    model = random_model(LlamaForCausalLM, LlamaConfig(**job["config"]), job["seed"])
    model.save_pretrained(job["dir"], safe_serialization=True)
    np.save(job["out"], logits_of(model, job["tokens"]))


if __name__ == "__main__":
    run_jobs({"logits": job_logits, "make": job_make})
