"""`python -m launch.gpu_check`: everything a short GPU loan should measure, as one command.

Sections, in order (sections.py), each in its own process under a time budget (runner.py):
device and ptxas (device.py), kernels (kernels.py), attention and fp8 (throughput.py), train
(train_step.py). Results: OUT/gpu_check.json and OUT/gpu_check.md (report.py), rewritten after
each section; see docs/gpu_check.md. Nothing here imports jax at the top: the parent process
never needs it.
"""

from titanax.perf.gpu_check.runner import run, run_worker
from titanax.perf.gpu_check.sections import DEFAULT_TIME_LIMIT_S, NAMES, SECTIONS, Section

__all__ = ["DEFAULT_TIME_LIMIT_S", "NAMES", "SECTIONS", "Section", "run", "run_worker"]
