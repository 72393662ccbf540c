"""gpu_check.json and gpu_check.md, rewritten after every section: a run cut short keeps what
it measured. The markdown is what docs/performance.md takes: one table per section."""

from __future__ import annotations

import json
import pathlib

from titanax.perf.gpu_check.context import write_json

# Columns the tables leave out (all stay in the JSON): nested detail, what every row repeats,
# and the train bench's secondary numbers.
_HIDDEN = {"errors", "step_times_s", "config", "causal", "kernel", "devices", "step_p10_s",
           "step_p90_s", "achieved_flops", "peak_flops", "max_rss_bytes", "flops_per_step",
           "uses"}
_INFO_HIDDEN = {"skipped", "reason", "traceback"}  # shown above the bullets, or JSON only


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, default=str)[:120]
    return str(v).replace("|", "\\|").replace("\n", " ")


def rows_table(rows: list[dict]) -> str:
    cols: list[str] = []
    for r in rows:
        cols += [k for k, v in r.items()
                 if k not in cols and k not in _HIDDEN and not isinstance(v, dict)]
    if not cols:
        return ""
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def tables(rows: list[dict]) -> list[str]:
    """One table per kind of row (the kernels section holds attention and FP8 matmul rows)."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get("kernel"), []).append(r)
    return [(f"**{k}**\n\n" if k else "") + rows_table(g) for k, g in groups.items()]


def markdown(report: dict) -> str:
    out = [f"# gpu_check{' (dry run)' if report['dry_run'] else ''}", "",
           f"`{report['command']}`, started {report['started']}, " + (
               "refused by the preflight: no section ran." if report.get("error") else
               f"{report.get('elapsed_s', 0):.0f} s of a {report['time_limit_s']:.0f} s limit."),
           ""]
    if report.get("error"):  # the preflight refused the run: nothing below ran
        out += [f"**error**: {_fmt(report['error'])}", ""]
    pre = {k: v for k, v in report.get("preflight", {}).items()
           if k not in ("versions", "error")}  # the error is the line above
    if pre:
        out += [f"- {k}: {_fmt(v)}" for k, v in pre.items()] + [""]
    if report.get("preflight", {}).get("versions"):
        out += [rows_table(report["preflight"]["versions"]), ""]
    out += ["| section | status | seconds | budget s |", "| --- | --- | --- | --- |"]
    for name, s in report["sections"].items():
        out.append(f"| {name} | {s['status']} | {_fmt(s.get('seconds', ''))} | "
                   f"{_fmt(s.get('budget_s', ''))} |")
    for i, (name, s) in enumerate(report["sections"].items(), 1):
        out += ["", f"## {i}. {name}: {s['status']}", "", s.get("what", "")]
        for key in ("reason", "error", "current"):
            if s.get(key):
                out += ["", f"**{key}**: {_fmt(s[key])}"]
        info = {k: v for k, v in s.get("info", {}).items() if k not in _INFO_HIDDEN}
        if info:
            out += [""] + [f"- {k}: {_fmt(v)}" for k, v in info.items()]
        for table in [s["markdown"]] if s.get("markdown") else tables(s.get("rows", [])):
            out += ["", table]
        if s.get("log"):
            out += ["", f"log: `{s['log']}`"]
    return "\n".join(out) + "\n"


def write(out_dir: pathlib.Path, report: dict) -> None:
    write_json(out_dir / "gpu_check.json", report)
    md = out_dir / "gpu_check.md"
    tmp = md.with_name(md.name + ".tmp")
    tmp.write_text(markdown(report))
    tmp.replace(md)
