"""lm-eval's `hf` model on an HF folder, run under the PyTorch venv (.venv-torch) for
tests/test_eval.py: `python lm_eval_peer.py JOBS.json`, each job
  {"dir": HF_DIR, "tasks": [NAME, ...], "include_path": DIR, "batch_size": B, "out": OUT.json}
writes lm-eval's results with every request's scores (log_samples) to OUT.json. float32, CPU."""

import json
import sys

from lm_eval import evaluator
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable


def main():
    for job in json.load(open(sys.argv[1])):
        results = evaluator.simple_evaluate(
            model="hf", model_args={"pretrained": job["dir"], "dtype": "float32"},
            tasks=job["tasks"], batch_size=job["batch_size"], device="cpu", log_samples=True,
            task_manager=TaskManager(include_path=job["include_path"], include_defaults=False))
        with open(job["out"], "w") as f:
            json.dump(results, f, default=handle_non_serializable)


if __name__ == "__main__":
    main()
