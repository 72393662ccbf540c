"""transformers' side of tests/test_score.py, run under .venv-torch: `python score_peer.py
JOBS.json`; float32 throughout.

Job: {"dir": HF_DIR, "texts": [str, ...], "chats": [[{role, content}, ...], ...], "out": J.json}
  scores each text and chat as a transformers user does: ids = tokenizer(text) (BOS as the
  tokenizer adds it) or apply_chat_template(chat, tokenize=True); logits = model(ids);
  logprob[t] = log_softmax(logits[t - 1])[ids[t]]; loss = model(ids, labels=ids).loss. For a
  chat ending in an assistant reply, also the reply's loss: labels -100 over the prompt (the
  conversation before it, rendered with the generation prompt). Writes per item {"ids",
  "logprobs", "loss", "assistant_loss"?} to J.json.
"""

import json

import torch
from peer_common import load, run_jobs
from transformers import AutoTokenizer


def score(model, ids, prompt_len=None):
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits.float()
        logp = torch.log_softmax(logits[0, :-1], dim=-1)
        picked = logp.gather(-1, x[0, 1:, None])[:, 0]
        out = {"ids": ids, "logprobs": picked.tolist(),
               "loss": float(model(input_ids=x, labels=x).loss)}
        if prompt_len is not None:
            labels = x.clone()
            labels[0, :prompt_len] = -100
            out["assistant_loss"] = float(model(input_ids=x, labels=labels).loss)
    return out


def chat_ids(tok, chat, **kw):
    return list(tok.apply_chat_template(chat, tokenize=True, return_dict=True, **kw)["input_ids"])


def run(job):
    tok = AutoTokenizer.from_pretrained(job["dir"])
    model = load(job["dir"])
    results = [score(model, list(tok(text)["input_ids"])) for text in job["texts"]]
    for chat in job["chats"]:
        prompt = (len(chat_ids(tok, chat[:-1], add_generation_prompt=True))
                  if chat[-1]["role"] == "assistant" else None)
        results.append(score(model, chat_ids(tok, chat), prompt))
    with open(job["out"], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    run_jobs(run)
