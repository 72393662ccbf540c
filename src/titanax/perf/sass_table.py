"""The SASS audit's markdown table (docs/attention.md and docs/fp8.md between BEGIN and END):
one line per kernel row that has an audit (part of titanax.perf.sass_audit).
"""

from __future__ import annotations

# --- the table -----------------------------------------------------------------------------------

BEGIN, END = "<!-- sass-audit:begin -->", "<!-- sass-audit:end -->"
SASS_COLUMNS = ("gpu", "impl", "pass", "hd", "variant", "MMA per tile", "EX2", "FP32", "ALU",
                "SMEM", "instr", "schedule", "in a wgmma window", "bound clk (unit)", "claims")


def _row_cells(r: dict) -> list[str]:
    a = r["sass"]
    base = [r["gpu"], r["impl"], r["pass"], str(r.get("head_dim") or ""), r["variant"]]
    if "error" in a:
        return base + [f"**{a['error']}**"] + [""] * (len(SASS_COLUMNS) - len(base) - 1)
    mma, work = a["mma"], a.get("softmax") or a["mma"]
    c = work["counts"]
    sched = mma["schedule"] if "softmax" not in a else \
        f"MMA warp: {mma['schedule']}; softmax: {a['softmax']['schedule']}"
    if "overlapped" in mma:
        ov = mma["overlapped"]
        window = (f"{ov['ex2']}/{mma['counts']['ex2']} EX2, "
                  f"{ov['mma']}/{mma['counts']['mma']} MMA")
    elif "UTC" in mma["mma_kinds"]:
        window = "n/a (tcgen05: mbarriers)"
    else:
        window = "n/a (mma.sync)"
    b = a["bound"]
    tensor = "?" if b["tensor"] is None else b["tensor"]  # a UTC*MMA's shape not in the SASS
    bound = f"{b['bound']} ({b['limiter']}{'' if b['limiter'] == 'tensor' else f'; tensor {tensor}'})"
    return base + [mma["mma_kinds"], str(c["ex2"]), str(c["fp32"]), str(c["alu"]),
                   str(c["smem"]), str(c["total"]), f"`{sched}`", window, bound,
                   r.get("claims", "none")]


def markdown_table(rows: list[dict]) -> str:
    """One line per kernel row that has a SASS audit."""
    lines = ["| " + " | ".join(SASS_COLUMNS) + " |", "|" + "|".join("---" for _ in SASS_COLUMNS)
             + "|"]
    lines += ["| " + " | ".join(x.replace("|", "\\|") for x in _row_cells(r)) + " |"
              for r in rows if "sass" in r]
    return "\n".join(lines)
