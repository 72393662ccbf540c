"""The fit answer of `launch.plan --no-compile`: the smallest change that fits by the cost
model's memory (plan/memory_model.py), where plan/fit.py compiles its candidates. The same
changes in the same order (plan.fit.candidate_groups: train.grad_accum up the divisors of the
per-device batch, each remat policy that saves more, the master weights in host memory when
the optimizer is there), then what plan.fit leaves to `--search`: the optimizer's moments in
host memory (alone, then with the master weights or full_offload's layer inputs), and last
more GPUs (nodes doubled, up to 64 times the cluster's, at the smallest grad_accum that fits).
train.grad_accum=auto under --no-compile takes this answer, and the plan says it is the cost
model's."""

from __future__ import annotations

import dataclasses

from titanax.config import Config, ConfigError, apply_overrides
from titanax.config.parallel import batch_ways
from titanax.plan.cluster import Cluster, layout_for
from titanax.plan.cost_model import estimate
from titanax.plan.fit import _value, candidate_groups, size
from titanax.plan.state_shape import plan_state

MORE_NODES = 64  # at most this many times the cluster's nodes


def _memory(cfg: Config, cluster: Cluster) -> tuple[float, float] | None:
    """(modelled bytes per device, usable bytes), or None when the config refuses the layout."""
    try:
        est = estimate(cfg, cluster, layout_for(cfg, cluster))
    except ConfigError:
        return None
    return est.memory["total"], est.usable_memory_bytes


def _smallest(cfg: Config, cluster: Cluster, base: dict, ladder: list[int]
              ) -> tuple[dict, float] | None:
    """The fewest microbatches of `ladder` at which cfg with base fits the model (and the
    config accepts), with its modelled bytes."""
    for k in ladder:
        overrides = {**base, "train.grad_accum": k}
        try:
            c = apply_overrides(cfg, overrides)
        except ConfigError:
            continue
        got = _memory(c, cluster)
        if got and got[0] <= got[1]:
            return overrides, got[0]
    return None


def _first_fit(cfg: Config, cluster: Cluster, extra: dict) -> tuple[dict, float] | None:
    """plan.fit's candidate order on cfg with extra applied (the extra itself first)."""
    try:
        base = apply_overrides(cfg, extra) if extra else cfg
        ways = batch_ways(layout_for(base, cluster).degrees)
    except ConfigError:
        return None
    start = base.train.known_grad_accum
    if extra and (got := _smallest(base, cluster, {}, [start])):
        return {**extra, **got[0]}, got[1]
    for overrides, ladder in candidate_groups(base, ways):
        if got := _smallest(base, cluster, overrides, ladder):
            return {**extra, **got[0]}, got[1]
    return None


def model_fit(cfg: Config, cluster: Cluster, *, broad: bool = True) -> dict:
    """{'fits', 'line', 'overrides', 'bytes', 'nodes', 'source': 'cost model'}: cfg's
    modelled memory against the usable HBM and, when it does not fit, the first change that
    does (module docstring); 'nodes' > cluster.nodes when only more GPUs fit. broad=False:
    only the changes train.grad_accum=auto may take (plan.fit's: no host offload the config
    did not ask for, no more GPUs)."""
    est = estimate(cfg, cluster, layout_for(cfg, cluster))
    need, usable = est.memory["total"], est.usable_memory_bytes
    head = (f"the cost model puts the step at {size(need)} per device of {size(usable)} "
            f"usable")
    out = {"fits": need <= usable, "overrides": None, "bytes": 0, "nodes": cluster.nodes,
           "source": "cost model"}
    if out["fits"]:
        return {**out, "line": f"{head}: fits"}
    t = cfg.train
    extras = [{}]
    # (host offload only where what the run trains takes it: not LoRA's, plan/training.py)
    if broad and not t.offload_optimizer and plan_state(cfg).training.host_offload:
        extras += [{"train.offload_optimizer": True},
                   {"train.offload_optimizer": True, "execution.remat": "full_offload"}]
    for extra in extras:
        if got := _first_fit(cfg, cluster, extra):
            overrides, nbytes = got
            flags = " ".join(f"--set {k}={_value(v)}" for k, v in overrides.items())
            return {**out, "overrides": overrides, "bytes": int(nbytes),
                    "line": f"{head}; {flags} fits ({size(nbytes)} by the cost model)"}
    nodes = cluster.nodes * 2
    while broad and nodes <= cluster.nodes * MORE_NODES:
        bigger = dataclasses.replace(cluster, nodes=nodes)
        if got := _first_fit(cfg, bigger, {}):
            overrides, nbytes = got
            flags = " ".join(f"--set {k}={_value(v)}" for k, v in overrides.items()
                             if not (k == "train.grad_accum" and v == t.known_grad_accum))
            return {**out, "overrides": overrides, "bytes": int(nbytes), "nodes": nodes,
                    "line": f"{head}; no setting fits {cluster.n_gpus} GPUs: --nodes {nodes} "
                            f"({bigger.n_gpus} GPUs){' ' + flags if flags else ''} fits "
                            f"({size(nbytes)} by the cost model)"}
        nodes *= 2
    if not broad:
        return {**out, "line": f"{head}; no train.grad_accum or execution.remat setting fits"}
    return {**out, "line": f"{head}; no train.grad_accum, execution.remat, host offload or up "
                           f"to {MORE_NODES} times the nodes fits: see --search for other layouts"}
