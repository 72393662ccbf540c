"""The plan as text for the terminal, and plan.json."""

from __future__ import annotations

import json
import pathlib

from titanax.plan.audit import format_audit
from titanax.plan.lora import lora_lines, lora_step_lines

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB"


def _memory_lines(plan: dict) -> list[str]:
    lines = []
    comp = plan.get("compile") or {}
    if comp.get("ok") and comp["target"] != "gpu":
        lines.append("  compiled for simulated CPU devices: the step compiles (its memory, "
                     "XLA:CPU's, is not the GPU's and is not used here)")
    elif comp.get("ok"):
        m = comp["memory"]
        lines.append(f"  compiled ({comp['target']}): arguments {_gb(m['arguments'])}, temporaries "
                     f"{_gb(m['temporaries'])}, outputs not aliased {_gb(m['outputs'] - m['aliased'])}"
                     f" -> total {_gb(m['total'])} per device")
        if comp.get("peak_buffers"):
            from titanax.plan.buffers import format_buffers
            lines += format_buffers(comp["peak_buffers"])
    elif comp:
        lines.append(f"  compile FAILED: {comp.get('error', '')[:400]}")
    model = plan["memory_model_bytes"]
    parts = ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in model.items() if k != "total")
    lines.append(f"  cost model: {parts} -> total {_gb(model['total'])}")
    host = plan.get("host_memory_model_bytes") or {}
    if host.get("total"):
        parts = ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in host.items()
                          if k != "total")
        compiled_host = ""
        if comp.get("ok") and comp["memory"].get("host_total"):
            compiled_host = f"; compiled: {_gb(comp['memory']['host_total'])}"
        lines.append(f"  pinned host memory (offload): {parts} -> {_gb(host['total'])} per "
                     f"device{compiled_host}")
    hbm, usable, per = plan["device_memory_bytes"], plan["usable_memory_bytes"], plan["per_device_bytes"]
    verdict = (f"FITS with {_gb(usable - per)} to spare" if plan["fits"] else
               f"DOES NOT FIT by {_gb(per - usable)}")
    lines.append(f"  => {_gb(per)} per device ({plan['per_device_bytes_source']}) of {_gb(hbm)} "
                 f"HBM ({_gb(usable)} usable): {verdict}")
    fit = plan.get("fit")
    if plan.get("grad_accum_auto"):  # the change auto took (the plan is of it)
        lines.append(f"  => {plan['grad_accum_auto']}")
    elif fit and not fit["fits"]:  # what launch.train would say, with the --set to copy
        lines.append(f"  => {fit['line']}")
    return lines


def _documents_line(plan: dict) -> list[str]:
    """What packed documents do to attention's work, when the step masks them."""
    doc = plan.get("documents") or {}
    if not doc.get("masked"):
        return []
    if doc.get("mean_tokens") is None:
        return ["documents: masked, length unknown (no meta.json): attention counted as plain "
                "causal; give --doc-len N"]
    return [f"documents: {doc['mean_tokens']:,.0f} tokens on average ({doc['source']}): "
            f"attention computes {doc['attention_share']:.1%} of the S x S scores "
            "(plain causal: 50%)"]


def _context_setting(plan: dict) -> str:
    s = plan["settings"]
    if plan["layout"]["degrees"].get("context", 1) == 1:
        return ""
    return (f", context {plan['layout']['degrees']['context']} ({s['context_strategy']}: "
            f"{s['seq_len'] // plan['layout']['degrees']['context']} tokens of each sequence "
            "per device)")


def _expert_lines(plan: dict) -> list[str]:
    """The 'expert' row's exchange (plan/moe.py), and the dropless buffers' cost when dropless."""
    ep = plan.get("expert_parallel")
    if not ep:
        return []
    how = ("dropless" if ep["dropless"] else f"capacity factor {ep['capacity_factor']:g}")
    lines = [f"  expert all-to-alls: {ep['tokens_per_device']:,} tokens x top-k = "
             f"{ep['pairs_per_device']:,} pairs per device and layer, C = "
             f"{ep['rows_per_destination']:,} rows per destination ({how}): each [expert, C, "
             f"D] buffer {_gb(ep['buffer_bytes'])}"]
    if ep.get("advice"):
        lines.append(f"  => {ep['advice']}")
    return lines


def _overlap(axis: str, x: dict) -> str:
    if x["overlapped_with_compute"]:
        return "(overlapped with compute)"
    hidden = x.get("hidden_under_compute_s", 0.0)
    if hidden:
        # the context ring hides under the attention, the tensor ring (collective matmul)
        # under the GEMMs it runs beside
        under = "GEMMs" if axis == "tensor" else "attention"
        return f"({hidden:.2f} s hidden under {under}, {x['seconds'] - hidden:.2f} s exposed)"
    return "(exposed)"


def _group(axis: str, x: dict) -> str:
    """' over fsdp x context' when the collective runs over more mesh axes than its name."""
    axes = x.get("mesh_axes") or [axis]
    return f" over {' x '.join(axes)}" if axes != [axis] else ""


def format_plan(plan: dict) -> str:
    c = plan["cluster"]
    out = [f"cluster: {c['description']}"]
    if "configured_layout_error" in plan:
        out.append(f"configured layout: {plan['configured_layout_error']}")
    if "params" in plan:
        s = plan["settings"]
        out += [
            f"layout: {plan['layout']['description']} (inside NVLink domains: "
            + (" x ".join(f"{a}={n}" for a, n in plan['layout']['inside_nvlink_domain'].items()
                          if n > 1) or "-")
            + "; across: " + (" x ".join(f"{a}={n}" for a, n in
                                        plan['layout']['across_domains'].items() if n > 1) or "-")
            + ")",
            f"settings: batch {s['batch_size']} x seq {s['seq_len']}, grad_accum "
            f"{s['grad_accum']}, remat {s['remat']}, attention {s['attention_impl']}, matmul "
            f"{s['matmul_precision']}" + _context_setting(plan)
            + (", tp_overlap" if s.get("tp_overlap") else "")
            + (", layer loop single-buffered" if s.get("loop_double_buffering") is False else ""),
            *_documents_line(plan),
            f"compiled for: {plan['compiled_for']}"
            + (f" in {plan['compile']['compile_s']:.1f} s (lowering {plan['compile']['lower_s']:.1f}"
               " s)" if (plan.get("compile") or {}).get("ok") else ""),
            f"parameters: {plan['params']:,} ({plan['params_no_embedding']:,} without the input "
            "embedding)", *lora_lines(plan),
            *([f"note: {plan['moe_note']}"] if plan.get("moe_note") else []),
            f"FLOPs: {plan['flops_per_token']:.3e} per token, {plan['flops_per_step']:.3e} per step "
            f"of {plan['tokens_per_step']:,} tokens ({plan['flop_formula']})",
            "memory per device:", *_memory_lines(plan),
            "communication per device and step:"]
        comm = plan["communication_bytes_per_step"]
        if not comm:
            out.append("  none (one device per replica of every axis)")
        for a, x in comm.items():
            out.append(f"  {a:8s} x{x['degree']:<3d} {x['link']:10s} {_gb(x['bytes']):>10s} at "
                       f"{x['bus_bandwidth'] / GB:.0f} GB/s -> {x['seconds']:.2f} s "
                       + _overlap(a, x) + _group(a, x))
        out += _expert_lines(plan)
        b = plan["time_breakdown_s"]
        out += [
            "predicted step: " + ", ".join(f"{k} {v:.2f} s" for k, v in b.items() if v)
            + f"; pipeline bubble {plan['pipeline_bubble']:.1%}",
            f"  => {plan['predicted_step_s']:.2f} s per step, "
            f"{plan['predicted_tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU "
            f"{plan['predicted_mfu']:.1%} (of dense bf16 peak)"]
        out += lora_step_lines(plan)
        host = plan.get("host_offload_cost_s")
        if b.get("host_offload_exposed") or b.get("host_offload_overlapped"):
            out.append(f"  => host offload costs {host or 0.0:.2f} s of the step "
                       f"({(host or 0.0) / plan['predicted_step_s']:.1%}): "
                       f"{b.get('host_offload_exposed', 0.0):.2f} s of the update's copies "
                       "after the backward, and "
                       f"{b.get('host_offload_overlapped', 0.0):.2f} s of copies during the "
                       "layers, hidden where they fit under their compute")
        spread = plan.get("predicted_tokens_per_s_spread")
        if spread:
            out.append(f"  => how sure: {spread['text']} (plan/published.py)")
    if "audit" in plan:
        out.append(format_audit(plan["audit"]))
    if "search" in plan:
        out.append(format_search(plan["search"]))
    return "\n".join(out)


def format_search(s: dict) -> str:
    out = [f"search: {s['candidates']} candidates, {s['fitting']} fit"]
    for i, r in enumerate(s["ranked"], 1):
        out.append(f"  {i:2d}. {r['predicted_tokens_per_s_per_gpu']:8,.0f} tok/s/GPU  MFU "
                   f"{r['predicted_mfu']:.1%}  {_gb(r['per_device_bytes']):>9s}  {r['layout']}")
    out.append("  dropped: " + ", ".join(f"{n} {k}" for k, n in s["dropped_by_reason"].items()))
    for r in s["dropped"][:5]:
        out.append(f"    e.g. {r['layout']}: {r['dropped'][:200]}")
    for v in s["verified"]:
        mem = f"{_gb(v['memory']['total'])} per device" if v.get("memory") else ""
        out.append(f"  compile check of {v['layout']}: {v['compiled_for']} {mem} "
                   + (f"-> dropped: {v['dropped']}" if v["dropped"] else "-> ok"))
    if s["best"] is not None:
        b = s["best"]
        checked = ("compile-checked" if b["compile_checked"] else
                   f"NOT compile-checked: {b.get('unchecked_why', 'raise --verify')}")
        out.append(f"  best ({checked}): {b['label']}: {b['predicted_tokens_per_s_per_gpu']:,.0f}"
                   f" tok/s/GPU, {b['per_device_bytes'] / GB:.1f} GB per device "
                   f"({b['per_device_bytes_source']}); run it with "
                   + " ".join(f"--set {o}" for o in b["overrides"]))
    return "\n".join(out)


def write_json(plan: dict, path: pathlib.Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1, default=float) + "\n")
