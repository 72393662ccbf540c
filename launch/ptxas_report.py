"""Machine-code (ptxas) report of every GPU kernel: registers, spills, stack, shared memory and
TMEM per kernel at the shipped configs, deviceless (the CUDA plugin of .venv/cuda-plugin).
Prints a table; exits 1 when a kernel spills or breaks an SM budget (titanax.perf.ptxas_report).

    python -m launch.ptxas_report                              # h100 and b200, head dims 64-256
    python -m launch.ptxas_report --gpu b200 --head-dims 128 --json runs/ptxas_b200.json
    python -m launch.ptxas_report --write-docs                 # refresh the tables in docs/
    python -m launch.ptxas_report --gpu h100 --on-device       # on an H100: the local GPU
    python -m launch.ptxas_report --sm90-fwd-overlap --regs 0 168 200 232
        # the sm90 forward, FlashConfig.fwd_overlap off and on, at each compute-warpgroup
        # register budget (0: the shipped one): how close each runs to its setmaxnreg budget
    python -m launch.ptxas_report --sm90-bwd-fused --head-dims 64 128
        # the sm90 fused backward (FlashConfig.bwd_fused) at each head dim, also where
        # flash_bwd does not run it yet (kernel_sm90_bwd.FUSED_MAX_HEAD_DIM): its spills there
    python -m launch.ptxas_report --gpu h100 b200 --sass [--write-docs]
        # also the SASS audit (titanax.perf.sass_audit): per kernel its main loop's
        # instructions per tile by class, the wgmma overlap windows, a static cycle bound per
        # tile, and whether each overlap its config declares (OVERLAP_CLAIMS) is in the SASS;
        # exits 1 when one is not (needs nvdisasm: bash scripts/dev.sh cuda-plugin)
"""

from __future__ import annotations

import argparse
import json
import pathlib

DOCS = {"attention": "docs/attention.md", "fp8_matmul": "docs/fp8.md"}


def write_docs(rows: list[dict], repo: pathlib.Path, sass: bool = False) -> None:
    from titanax.perf import sass_audit
    from titanax.perf.ptxas_report import markdown_table, replace_between_markers

    for op, doc in DOCS.items():
        mine = [r for r in rows if r["op"] == op]
        if mine:
            path = repo / doc
            path.write_text(replace_between_markers(path.read_text(), markdown_table(mine)))
            print(f"wrote {len(mine)} rows to {doc}")
        if mine and sass:
            path.write_text(replace_between_markers(
                path.read_text(), sass_audit.markdown_table(mine), sass_audit.BEGIN,
                sass_audit.END))
            print(f"wrote {len(mine)} SASS rows to {doc}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.ptxas_report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", nargs="+", default=["h100", "b200"],
                   help="GPU kinds (h100/h200: sm_90a, b200/gb200: sm_100a)")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--json", default=None, metavar="OUT", help="also write the rows as JSON")
    p.add_argument("--write-docs", action="store_true",
                   help="replace the marked tables in docs/attention.md and docs/fp8.md")
    p.add_argument("--on-device", action="store_true",
                   help="compile for the local GPU instead (one --gpu, of its kind)")
    p.add_argument("--sm90-fwd-overlap", action="store_true",
                   help="only the Hopper forward, fwd_overlap off and on, at each --regs budget")
    p.add_argument("--sm90-bwd-fused", action="store_true",
                   help="only the Hopper fused backward, at every --head-dims, gate lifted")
    p.add_argument("--regs", nargs="+", type=int, default=[0],
                   help="with --sm90-fwd-overlap: setmaxnreg budgets (0: the shipped one)")
    p.add_argument("--sass", action="store_true",
                   help="also audit each kernel's SASS (main loop, overlap windows, bound)")
    args = p.parse_args(argv)

    from pallas_kernels import aot
    from titanax.perf import sass_audit
    from titanax.perf.ptxas_report import check, collect, collect_all, markdown_table

    if args.on_device and len(args.gpu) != 1:
        raise SystemExit("--on-device compiles for the local GPU: pass its one --gpu kind")
    if not args.on_device and not aot.plugin_available():
        raise SystemExit("the CUDA plugin is missing from .venv/cuda-plugin: "
                         "bash scripts/dev.sh cuda-plugin installs it")
    if args.sass and not sass_audit.nvdisasm_path():
        raise SystemExit("--sass needs nvdisasm in the CUDA plugin (nvidia/cuda_nvcc/bin): "
                         "bash scripts/dev.sh cuda-plugin installs it")
    if args.sm90_fwd_overlap:
        rows = collect("h100", tuple(args.head_dims), overlap_budgets=tuple(args.regs),
                       sass=args.sass)
    elif args.sm90_bwd_fused:
        rows = collect("h100", tuple(args.head_dims), fused_bwd=True, sass=args.sass)
    else:
        rows = collect_all(tuple(args.gpu), tuple(args.head_dims), args.on_device, args.sass)
    print(markdown_table(rows))
    if args.sass:
        ptxas = sorted({r["ptxas"] for r in rows if r.get("ptxas")})
        print(f"\nSASS audit (ptxas: {'; '.join(ptxas)}):\n" + sass_audit.markdown_table(rows))
    if args.json:
        pathlib.Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.write_docs:
        write_docs(rows, aot.REPO, args.sass)
    problems = check(rows)
    if problems:
        print(f"\n{len(problems)} kernel(s) over budget:\n" + "\n".join(problems))
    claims = sass_audit.problems(rows) if args.sass else []
    if claims:
        print(f"\n{len(claims)} SASS audit problem(s):\n" + "\n".join(claims))
    if problems or claims:
        raise SystemExit(1)


# No TCMalloc re-exec (launch.common.use_tcmalloc): the compiles run in worker subprocesses,
# and nothing here runs XLA steps.
if __name__ == "__main__":
    main()
