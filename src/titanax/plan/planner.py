"""One planning run: the config's layout on the cluster, the cost model, the deviceless compile
of the real step, and optionally the layout search with the winner compile-checked.
Returns the plan as a dict (what plan.json holds); report.py prints it, render.py draws it."""

from __future__ import annotations

import dataclasses

from titanax.config import Config, ConfigError, apply_overrides
from titanax.parallel.rules import MESH_AXES
from titanax.plan import compile as plan_compile
from titanax.plan import published
from titanax.plan import search as plan_search
from titanax.plan.cluster import Cluster, Layout, PlanError, layout_for, plan_config
from titanax.plan.cost_model import EFFICIENCIES, Estimate, estimate
from titanax.plan.documents import documents_summary
from titanax.plan.fit import auto_choice
from titanax.plan.model_fit import model_fit
from titanax.plan.moe import dispatch_json
from titanax.plan.state_shape import plan_state
from titanax.plan.step_shape import StepShape
from titanax.train.throughput import FLOP_FORMULA


def _layout_json(layout: Layout) -> dict:
    return {"degrees": layout.degrees, "inside_nvlink_domain": layout.inner,
            "across_domains": layout.outer, "nvlink_domain_size": layout.domain_size,
            "description": layout.describe()}


# Said wherever a plan's memory is the cost model's because no GPU compile could run.
NO_PLUGIN = ("no CUDA plugin, so the memory below is the cost model's guess (a CPU compile's "
             "memory is not the GPU's); `bash scripts/dev.sh cuda-plugin` installs the plugin "
             "(4.9 GB, once) and launch.plan then compiles for the GPU")


def _spread(tokens_per_s: float) -> dict:
    """The prediction with the spread of published runs against the model (plan/published.py)."""
    u = published.uncertainty()
    return {"low": tokens_per_s * u["low"], "high": tokens_per_s * u["high"],
            "low_ratio": u["low"], "high_ratio": u["high"], "published_rows": u["rows"],
            "text": published.describe(tokens_per_s, u)}


def _compiled_for(result: dict | None, cluster: Cluster) -> str:
    if result is None:
        return "none (cost model only)"
    where = (f"deviceless CUDA {result.get('device_kind', cluster.gpu)}, {cluster.nodes} host(s)"
             f" x {cluster.gpus_per_node}" if result["target"] == "gpu" else
             f"simulated CPU devices ({cluster.n_gpus}): {NO_PLUGIN}")
    return where if result.get("ok") else f"{where}: FAILED"


def evaluate(cfg: Config, cluster: Cluster, *, compile_step: bool, buffers: int = 0,
             audit: bool = False) -> dict:
    """Plan for cfg as configured (its mesh, batch, remat) on the cluster; audit: also the
    audit of the compiled step (plan/audit.py), as the plan's "audit"."""
    try:
        layout = layout_for(cfg, cluster)
    except ConfigError as e:
        raise PlanError(f"the config's layout does not work on {cluster.n_gpus} GPUs: {e}. "
                        "Change it with --set mesh.*=... or try --search") from None
    est = estimate(cfg, cluster, layout)
    if not compile_step:
        plan = _plan_dict(cfg, cluster, layout, est, None)
        if not plan["fits"]:  # the fix, by the cost model (nothing compiled to measure it)
            plan["fit"] = model_fit(cfg, cluster)
        return plan
    hw = cluster.hardware
    fit = {"capacity": int(est.usable_memory_bytes),
           "where": f"{est.usable_memory_bytes / hw.hbm_bytes:.0%} of the {hw.name}'s "
                    f"{hw.hbm_bytes / 1e9:.1f} GB"}
    compiled = plan_compile.compile_in_subprocess(cfg, cluster, buffers=buffers, fit=fit,
                                                  audit=audit)
    plan = _plan_dict(cfg, cluster, layout, est, compiled)
    if compiled.get("fit"):  # the line to copy when it does not fit
        plan["fit"] = {k: v for k, v in compiled["fit"].items() if k != "result"}
    return plan


def evaluate_auto(cfg: Config, cluster: Cluster, *, compile_step: bool, buffers: int = 0,
                  audit: bool = False):
    """evaluate() for train.grad_accum=auto: planned at 1, then at the smallest change whose
    compiled step fits (plan.fit: what launch.train would choose on those GPUs; a remat
    policy or the master weights in host memory too, when grad_accum alone is not enough),
    when one does."""
    cfg = apply_overrides(cfg, {"train.grad_accum": 1})
    plan = evaluate(cfg, cluster, compile_step=compile_step, buffers=buffers, audit=audit)
    if not compile_step:
        return _auto_by_model(cfg, cluster, plan)
    fit = (plan.get("compile") or {}).get("fit") or {}
    if fit.get("fits"):
        plan["grad_accum_auto"] = "train.grad_accum=auto -> 1"
    elif fit.get("overrides"):  # whatever the answer changes (remat, offload_params too)
        chosen = apply_overrides(cfg, fit["overrides"])
        layout = layout_for(chosen, cluster)
        result = {**fit["result"], "ok": True}
        plan = {**_plan_dict(chosen, cluster, layout, estimate(chosen, cluster, layout), result),
                "fit": plan["fit"],
                "grad_accum_auto": auto_choice(
                    fit["overrides"], f"{fit['bytes'] / 1e9:.1f} GB, where grad_accum 1 "
                    f"needs {plan['per_device_bytes'] / 1e9:.1f} GB", fit.get("why", ""))}
    return plan


def _auto_by_model(cfg: Config, cluster: Cluster, plan: dict) -> dict:
    """train.grad_accum=auto under --no-compile: the cost model's smallest change that fits
    (plan/model_fit.py), said to be the model's; launch.train measures it by compiling."""
    why = "by the cost model: --no-compile; launch.train compiles it"
    if plan["fits"]:
        return {**plan, "grad_accum_auto": f"train.grad_accum=auto -> 1 ({why})"}
    fit = model_fit(cfg, cluster, broad=False)  # what launch.train's auto may change
    if not fit["overrides"]:
        return {**plan, "grad_accum_auto": f"train.grad_accum=auto: no grad_accum or remat "
                f"fits {cluster.n_gpus} GPUs ({why}); {plan['fit']['line']}"}
    chosen = apply_overrides(cfg, fit["overrides"])
    layout = layout_for(chosen, cluster)
    memory = (f"{fit['bytes'] / 1e9:.1f} GB, where grad_accum 1 needs "
              f"{plan['per_device_bytes'] / 1e9:.1f} GB, {why}")
    return {**_plan_dict(chosen, cluster, layout, estimate(chosen, cluster, layout), None),
            "fit": fit, "grad_accum_auto": auto_choice(fit["overrides"], memory)}


def _plan_dict(cfg: Config, cluster: Cluster, layout: Layout, est: Estimate,
               compiled: dict | None) -> dict:
    hw = cluster.hardware
    audit = (compiled or {}).get("audit")
    if audit is not None:  # a key of its own in plan.json, not inside "compile"
        compiled = {k: v for k, v in compiled.items() if k != "audit"}
    trust_compiled = bool(compiled and compiled.get("ok") and compiled["target"] == "gpu")
    per_device = compiled["memory"]["total"] if trust_compiled else est.memory["total"]
    usable = est.usable_memory_bytes
    return {
        "cluster": {"gpu": cluster.gpu, "gpu_name": hw.name, "nodes": cluster.nodes,
                    "gpus_per_node": cluster.gpus_per_node, "gpus": cluster.n_gpus,
                    "nvlink_domain": cluster.nvlink_domain, "description": cluster.describe()},
        "hardware": dataclasses.asdict(hw),
        "layout": _layout_json(layout),
        "settings": {"batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
                     "grad_accum": cfg.train.grad_accum, "remat": cfg.execution.remat,
                     "attention_impl": cfg.execution.attention_impl,
                     "matmul_precision": cfg.execution.matmul_precision,
                     "loss_chunk": cfg.train.loss_chunk,
                     "offload_optimizer": cfg.train.offload_optimizer,
                     "offload_params": cfg.train.offload_params,
                     "context_strategy": cfg.execution.context_strategy,
                     "tp_overlap": cfg.execution.tp_overlap,
                     "loop_double_buffering": cfg.execution.loop_double_buffering,
                     "pipeline": dataclasses.asdict(cfg.pipeline)},
        "documents": documents_summary(cfg),
        "compiled_for": _compiled_for(compiled, cluster),
        "compile": compiled,
        "params": est.params,
        "params_no_embedding": est.params_no_embed,
        "flop_formula": FLOP_FORMULA,
        "flops_per_token": est.flops_per_token,
        "flops_per_step": est.flops_per_step,
        "tokens_per_step": est.tokens_per_step,
        "per_device_bytes": int(per_device),
        "per_device_bytes_source": "compiled" if trust_compiled else "cost model",
        "memory_model_bytes": {k: int(v) for k, v in est.memory.items()},
        "host_memory_model_bytes": {k: int(v) for k, v in est.host_memory.items()},
        "device_memory_bytes": int(hw.hbm_bytes),
        "usable_memory_bytes": int(usable),
        "fits": per_device <= usable,
        "margin_bytes": int(usable - per_device),
        "communication_bytes_per_step": {
            a: {"bytes": c.bytes_per_step, "link": c.link, "degree": c.degree,
                "bus_bandwidth": c.bus_bandwidth, "calls": c.calls, "seconds": c.seconds,
                "overlapped_with_compute": c.overlapped, "hidden_under_compute_s": c.hidden_s,
                "mesh_axes": list(c.over or (a,))}
            for a, c in est.comm.items()},
        "pipeline_bubble": est.bubble,
        "time_breakdown_s": est.breakdown_s,
        "predicted_step_s": est.step_s,
        "host_offload_cost_s": est.host_offload_cost_s,
        "predicted_tokens_per_s_per_gpu": est.tokens_per_s_per_gpu,
        "predicted_mfu": est.mfu,
        "predicted_tokens_per_s_spread": _spread(est.tokens_per_s_per_gpu),
        "efficiencies": dataclasses.asdict(EFFICIENCIES),
        # what the run trains says (plan/lora.py: "lora") and the architecture's note
        # (models/common/moe_plan.py: "moe_note")
        **plan_state(cfg).training.plan_json(cfg, est),
        **plan_state(cfg).terms.plan_json(),
        **({"expert_parallel": ep} if (ep := dispatch_json(
            cfg, StepShape.of(cfg, layout.degrees))) else {}),
        **({"audit": audit} if audit is not None else {}),
    }


def run_search(cfg: Config, cluster: Cluster, *, verify: int, top: int = 10,
               max_context: int = 0, audit: bool = False) -> dict:
    """The search, with up to `verify` of the best candidates compiled (on the GPU target,
    a candidate whose compiled memory exceeds the usable HBM is dropped and the next tried)."""
    kept, dropped = plan_search.search(cfg, cluster, max_context)
    best, tried = None, []
    for cand in kept[:verify] if verify else []:
        result = plan_compile.compile_in_subprocess(cand.cfg, cluster, audit=audit)
        entry = {"layout": cand.label, "compiled_for": _compiled_for(result, cluster)}
        if not result.get("ok"):
            cand.dropped = f"compile failed: {result['error'][:400]}"
        elif result["target"] == "gpu" and \
                result["memory"]["total"] > cand.estimate.usable_memory_bytes:
            cand.dropped = (f"does not fit once compiled: {result['memory']['total'] / 1e9:.1f}"
                            f" GB > {cand.estimate.usable_memory_bytes / 1e9:.1f} GB usable")
        # A CPU compile's memory is XLA:CPU's: never shown as the GPU's.
        entry.update(memory=result.get("memory") if result.get("target") == "gpu" else None,
                     compile_s=result.get("compile_s"), dropped=cand.dropped)
        tried.append(entry)
        if not cand.dropped:
            best = (cand, result)
            break
    verified_out = [c for c in kept[:verify] if c.dropped]
    dropped = verified_out + dropped
    kept = [c for c in kept if not c.dropped]
    if best is None and kept:
        best = (kept[0], None)
    out = {"candidates": len(kept) + len(dropped), "fitting": len(kept),
           "ranked": [c.row() for c in kept[:top]],
           "dropped_by_reason": plan_search.dropped_summary(dropped),
           "dropped": [c.row() for c in dropped],
           "verified": tried, "best": None}
    if best is not None:
        cand, result = best
        out["best"] = _plan_dict(cand.cfg, cluster, layout_for(cand.cfg, cluster),
                                 cand.estimate, result)
        out["best"]["label"] = cand.label
        out["best"]["compile_checked"] = bool(result and result.get("ok"))
        if not out["best"]["compile_checked"]:
            out["best"]["unchecked_why"] = (
                "--no-compile" if not verify else
                f"the {len(tried)} candidate(s) ranked above it failed to compile or did not "
                "fit; raise --verify")
        out["best"]["overrides"] = overrides_for(cand.cfg)
    return out


def overrides_for(cfg: Config) -> list[str]:
    """The --set flags that turn the searched config's knobs into this candidate."""
    vals = {f"mesh.{a}": getattr(cfg.mesh, a) for a in MESH_AXES}
    vals.update({"execution.remat": cfg.execution.remat, "train.grad_accum": cfg.train.grad_accum,
                 "execution.attention_impl": cfg.execution.attention_impl,
                 "train.offload_optimizer": cfg.train.offload_optimizer,
                 "train.offload_params": cfg.train.offload_params})
    if cfg.mesh.context > 1:
        vals["execution.context_strategy"] = cfg.execution.context_strategy
    if cfg.mesh.tensor > 1:
        vals["execution.tp_overlap"] = cfg.execution.tp_overlap
    if cfg.mesh.pipeline > 1:
        vals.update({"pipeline.schedule": cfg.pipeline.schedule,
                     "pipeline.microbatches": cfg.pipeline.microbatches,
                     "pipeline.virtual_stages": cfg.pipeline.virtual_stages})
    return [f"{k}={v}" for k, v in vals.items()]


def make_plan(cfg: Config, cluster: Cluster, *, compile_step: bool = True,
              search: bool = False, verify: int = 1, buffers: int = 0,
              max_context: int = 0, audit: bool = False) -> dict:
    """The plan (plan.json's dict); audit: with the audit of the compiled step ("audit")."""
    cfg = plan_config(cfg, cluster)
    plan_one = evaluate_auto if cfg.train.grad_accum_auto else evaluate
    try:
        plan = plan_one(cfg, cluster, compile_step=compile_step, buffers=buffers, audit=audit)
    except PlanError as e:
        if not search:
            raise
        plan = {"cluster": {"gpu": cluster.gpu, "nodes": cluster.nodes,
                            "gpus_per_node": cluster.gpus_per_node, "gpus": cluster.n_gpus,
                            "nvlink_domain": cluster.nvlink_domain,
                            "description": cluster.describe()},
                "configured_layout_error": str(e)}
    if search:
        plan["search"] = run_search(cfg, cluster, verify=verify if compile_step else 0,
                                    max_context=max_context, audit=audit)
        best = plan["search"]["best"]
        if "configured_layout_error" in plan and best is not None:
            # plan.json's top-level fields then describe the best layout found
            plan = {**best, "configured_layout_error": plan["configured_layout_error"],
                    "search": plan["search"]}
    return plan
