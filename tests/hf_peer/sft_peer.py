"""transformers' side of the fine-tuning tests (tests/test_sft.py), run under .venv-torch:
`python sft_peer.py JOBS.json`. Everything float32.

Jobs:
  {"op": "make", "dir": HF_DIR, "config": {LlamaConfig kwargs}, "seed": N,
   "tokenizer": tokenizer.json, "template": JINJA, "bos": str, "eos": str}
      a random LlamaForCausalLM and its PreTrainedTokenizerFast (with the chat template),
      saved with save_pretrained into HF_DIR: what an Instruct model's folder holds.
  {"op": "loss", "dir": HF_DIR, "chats": [[{role, content}, ...], ...], "out": J.json}
      the examples as transformers fine-tunes them: apply_chat_template with
      return_assistant_tokens_mask (the template's {% generation %} blocks), labels -100
      outside the assistant tokens, right padding; writes the model's loss (the mean over
      the loss-bearing tokens of the whole batch), and each example's ids and mask.
"""

import json

import torch
from peer_common import load, random_model, run_jobs
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)


def job_make(job):
    model = random_model(LlamaForCausalLM, LlamaConfig(**job["config"]), job["seed"])
    model.save_pretrained(job["dir"], safe_serialization=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=job["tokenizer"], bos_token=job["bos"],
                                  eos_token=job["eos"], pad_token=job["eos"])
    tok.chat_template = job["template"]
    tok.save_pretrained(job["dir"])


def job_loss(job):
    tok = AutoTokenizer.from_pretrained(job["dir"])
    model = load(job["dir"])
    encoded = [tok.apply_chat_template(c, tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True) for c in job["chats"]]
    width = max(len(e["input_ids"]) for e in encoded)
    ids = torch.full((len(encoded), width), tok.pad_token_id)
    attention = torch.zeros((len(encoded), width), dtype=torch.long)
    labels = torch.full((len(encoded), width), -100)
    for row, e in enumerate(encoded):
        n = len(e["input_ids"])
        ids[row, :n] = torch.tensor(e["input_ids"])
        attention[row, :n] = 1
        mask = torch.tensor(e["assistant_masks"], dtype=torch.bool)
        labels[row, :n] = torch.where(mask, ids[row, :n], -100)
    with torch.no_grad():
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    with open(job["out"], "w") as f:
        json.dump({"loss": float(loss), "ids": [e["input_ids"] for e in encoded],
                   "masks": [e["assistant_masks"] for e in encoded]}, f)


if __name__ == "__main__":
    run_jobs({"make": job_make, "loss": job_loss})
