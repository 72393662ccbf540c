"""PEFT's side of tests/test_lora_export.py, run under .venv-torch: `python peft_peer.py
JOBS.json`; float32 throughout.

Job: {"base": HF_DIR, "adapter": PEFT_DIR, "merged": HF_DIR, "tokens": T.npy, "out": DIR}
  loads the base with AutoModelForCausalLM and the adapter folder onto it with
  PeftModel.from_pretrained, and saves into DIR: peft.npy (the adapted model's logits),
  merged.npy (the logits of the merged export loaded as a plain model), base.npy (the base's
  logits), and report.json: the largest |difference| between each weight of peft's
  merge_and_unload() and the merged export's, and the names the two disagree on.
"""

import json
import pathlib

import numpy as np
import torch
from peer_common import load, logits_of, run_jobs
from peft import PeftModel


def run(job):
    out = pathlib.Path(job["out"])
    tokens = torch.from_numpy(np.load(job["tokens"]).astype(np.int64))
    base = load(job["base"])
    np.save(out / "base.npy", logits_of(base, tokens))
    adapted = PeftModel.from_pretrained(base, job["adapter"]).eval()
    np.save(out / "peft.npy", logits_of(adapted, tokens))
    modules = sorted({n.rsplit(".lora_A", 1)[0] for n, _ in adapted.named_parameters()
                      if ".lora_A" in n})
    peft_merged = adapted.merge_and_unload().state_dict()
    ours = load(job["merged"])
    np.save(out / "merged.npy", logits_of(ours, tokens))
    ours = ours.state_dict()
    diff = {k: float((peft_merged[k] - ours[k]).abs().max()) for k in peft_merged if k in ours}
    report = {"max_abs_diff": diff, "only_peft": sorted(set(peft_merged) - set(ours)),
              "only_ours": sorted(set(ours) - set(peft_merged)), "adapter_modules": modules}
    (out / "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    run_jobs(run)
