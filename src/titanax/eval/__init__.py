"""Evaluation of a run's checkpoint with lm-evaluation-harness (the `eval` extra): an adapter of
lm-eval's LM interface over the titanax model (lm.py), its batched scoring and decoding
(scoring.py), and the run that writes WORKDIR/eval/*.json (run.py). Offline tasks in tasks/."""
