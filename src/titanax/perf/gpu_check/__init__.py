"""`python -m launch.gpu_check`: everything a short GPU loan should measure, as one command.

Sections (sections.py), each in its own process under a time budget (runner.py), by default
in DEFAULT_ORDER: device (device.py), kernels (kernels.py), train (train_step.py), attention
and fp8 (throughput.py); ptxas (device.py) on request. Results: OUT/gpu_check.json and OUT/gpu_check.md (report.py), rewritten after
each section; see docs/gpu_check.md. Nothing here imports jax at the top: the parent process
never needs it.
"""

from titanax.perf.gpu_check.runner import run, run_worker
from titanax.perf.gpu_check.sections import (
    DEFAULT_ORDER,
    DEFAULT_TIME_LIMIT_S,
    NAMES,
    SECTIONS,
    Section,
)

__all__ = ["DEFAULT_ORDER", "DEFAULT_TIME_LIMIT_S", "NAMES", "SECTIONS", "Section", "run",
           "run_worker"]
