"""transformers' side of tests/test_hf_roundtrip.py, run under .venv-torch as one subprocess:
`python roundtrip_peer.py JOBS.json`; float32 throughout.

Jobs:
  {"op": "make", "dir": HF_DIR, "config": {LlamaConfig kwargs}, "seed": N,
   "tokenizer": tokenizer.json, "bos": TOKEN, "eos": TOKEN, "chat_template": STR?,
   "generation": {GenerationConfig kwargs}?}
      a random LlamaForCausalLM (norms randomised) saved with save_pretrained, its tokenizer
      (PreTrainedTokenizerFast over tokenizer.json, with the chat template) and, when given,
      its generation_config.json, as a published (Instruct) checkpoint ships them.
  {"op": "generate", "dir": EXPORT, "source": HF_DIR, "ids": [..], "max_new_tokens": N,
   "out": R.json}
      greedy generation (do_sample=False) from EXPORT on the prompt ids; writes the new ids,
      their text, whether EXPORT's GenerationConfig equals SOURCE's, and both tokenizers'
      chat templates applied to one conversation.
"""

import json

import torch
from peer_common import load, random_model, run_jobs
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f():"}]


def job_make(job):
    model = random_model(LlamaForCausalLM, LlamaConfig(**job["config"]), job["seed"])
    if "generation" in job:
        model.generation_config = GenerationConfig(**job["generation"])
    model.save_pretrained(job["dir"], safe_serialization=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=job["tokenizer"], bos_token=job["bos"],
                                  eos_token=job["eos"], chat_template=job.get("chat_template"))
    tok.save_pretrained(job["dir"])


def _chat(tok):
    return tok.apply_chat_template(CHAT, tokenize=False) if tok.chat_template else None


def job_generate(job):
    model = load(job["dir"])
    tok = AutoTokenizer.from_pretrained(job["dir"])
    ids = torch.tensor([job["ids"]], dtype=torch.long)
    gen = GenerationConfig.from_pretrained(job["dir"])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=job["max_new_tokens"],
                             pad_token_id=tok.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    source_gen = GenerationConfig.from_pretrained(job["source"])
    result = {"new": new, "text": tok.decode(new, skip_special_tokens=False),
              "generation": gen.to_diff_dict(), "same_generation": gen == source_gen,
              "chat": _chat(tok), "source_chat": _chat(AutoTokenizer.from_pretrained(job["source"])),
              "eos": gen.eos_token_id}
    with open(job["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    run_jobs({"make": job_make, "generate": job_generate})
