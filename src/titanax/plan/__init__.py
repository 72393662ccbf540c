"""The planner: will a config fit on a cluster that is not here, which layout is fastest, and
what throughput to expect. cluster.py (the target), compile.py (deviceless compile of the real
train step), cost_model.py (step time, composing memory_model.py, compute_model.py and
comm_model.py), search.py (layouts), planner.py (one run), report.py (text, plan.json),
render.py (plan.png).
`python -m launch.plan` is the command line; docs/planner.md explains the model."""

from titanax.plan.cluster import Cluster, PlanError
from titanax.plan.planner import make_plan

__all__ = ["Cluster", "PlanError", "make_plan"]
