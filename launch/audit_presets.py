"""Audit every shipped GPU preset as a GPU would run it (titanax.plan.preset_audit): configs/
llama3_{8b,70b,405b}.py at 2 layers and 5,120 tokens on one deviceless 8-GPU node, H100 and
B200, each matmul recipe, with and without packed documents. Exits 1 when a cell has a finding
or fails to compile. Needs the CUDA plugin (bash scripts/dev.sh cuda-plugin installs it); about 25 s a
cell on 2 cores.

    python -m launch.audit_presets                       # the whole matrix (42 cells)
    python -m launch.audit_presets --presets llama3_70b --gpus b200
    python -m launch.audit_presets --write-docs          # refresh docs/planner.md's table
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re

from launch.common import fail

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "planner.md"
BEGIN, END = "<!-- preset-audit:begin -->", "<!-- preset-audit:end -->"


def main(argv=None) -> None:
    from titanax.plan import preset_audit

    p = argparse.ArgumentParser(prog="python -m launch.audit_presets", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=list(preset_audit.PRESETS),
                   choices=preset_audit.PRESETS)
    p.add_argument("--gpus", nargs="+", default=list(preset_audit.PRECISIONS),
                   choices=list(preset_audit.PRECISIONS))
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    p.add_argument("--write-docs", action="store_true",
                   help=f"replace the table between {BEGIN} and {END} in docs/planner.md")
    args = p.parse_args(argv)
    cells = preset_audit.full_matrix(tuple(args.presets), tuple(args.gpus))
    try:
        rows = preset_audit.audit_cells(cells)
    except RuntimeError as e:
        fail(str(e))
    table = preset_audit.format_table(rows)
    print(table)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.write_docs:
        text = DOCS.read_text()
        if BEGIN not in text or END not in text:
            fail(f"{DOCS} has no {BEGIN} ... {END} section to replace")
        DOCS.write_text(re.sub(f"{re.escape(BEGIN)}.*?{re.escape(END)}",
                               lambda _: f"{BEGIN}\n{table}\n{END}", text, flags=re.S))
        print(f"wrote the table into {DOCS}")
    bad = [r for r in rows if not r["ok"] or r["findings"]]
    for r in bad:
        c = r["cell"]
        print(f"AUDIT: {c['preset']} {c['gpu']} {c['precision']} documents={c['documents']}: "
              + (r.get("error") or "; ".join(r["findings"])))
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
