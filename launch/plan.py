"""Plan a run on a GPU cluster without its GPUs: compile the real train step for the target
(deviceless CUDA, or simulated CPU devices without the plugin), predict memory, communication
and speed, optionally search layouts. Writes OUT/plan.json and OUT/plan.png.

    python -m launch.plan --config configs/llama3_70b.py --gpu h100 --nodes 8
    python -m launch.plan --config configs/llama3_70b.py --gpu b200 --nodes 1 --search
    python -m launch.plan --config configs/llama3_70b.py --gpu h100 --nodes 8 --search \
        --set train.seq_len=65536 --set model.max_seq_len=65536 --set train.batch_size=32
    python -m launch.plan --config configs/llama3_70b.py --gpu h100 --nodes 8 --audit \
        --set model.n_layers=2 --set train.seq_len=6144

--audit reads the optimized HLO of the compiled step (titanax.plan.audit): attention calls,
GEMMs by kind, matmul FLOPs against the expected, S x S arrays, largest buffers, collectives;
after writing plan.json it exits 1 with one line per finding.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from launch.common import add_config_flags, fail


def parse_args(argv=None) -> argparse.Namespace:
    from titanax.hardware import HARDWARE

    p = argparse.ArgumentParser(prog="python -m launch.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p, default_config=None)
    p.add_argument("--gpu", required=True, help=f"GPU kind: {', '.join(sorted(HARDWARE))}")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes (hosts)")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs per node (default: 8, or 4 for a GB200 compute tray)")
    p.add_argument("--search", action="store_true",
                   help="also try mesh layouts (tensor, context, pipeline, fsdp, data), "
                        "microbatches, remat policies and host offload; rank them")
    p.add_argument("--max-context", type=int, default=0, metavar="C",
                   help="with --search: the largest mesh.context (context parallelism) tried; "
                        "1 for none (default: as far as an NVLink domain beside tensor allows)")
    p.add_argument("--verify", type=int, default=6, metavar="K",
                   help="with --search: compile up to K of the best candidates until one fits "
                        "(default 6)")
    p.add_argument("--no-compile", action="store_true",
                   help="cost model only: skip the deviceless compile")
    p.add_argument("--buffers", type=int, default=0, metavar="N",
                   help="also list the N largest buffers live at the compiled step's memory "
                        "peak (plan.json: compile.peak_buffers)")
    p.add_argument("--doc-len", type=int, default=0, metavar="N",
                   help="plan attention for packed documents of N tokens on average (default: "
                        "the data.source shard folders' meta.json; needs a step that masks "
                        "documents: a shard folder as data.source, data.document_masking)")
    p.add_argument("--audit", action="store_true",
                   help="audit the compiled step's optimized HLO (plan.json: audit); exit 1 "
                        "with one line per finding (S x S arrays, dense-mask cuDNN attention, "
                        "dots outside a GEMM, matmul FLOPs >10%% above the expected)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where plan.json and plan.png go (default runs/plan-CONFIG-GPUxNODES)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    from titanax.config import ConfigError, load_config
    from titanax.plan import Cluster, PlanError, make_plan
    from titanax.plan.documents import assume_document_tokens
    from titanax.plan.render import render
    from titanax.plan.report import format_plan, write_json

    if args.config is None:
        fail("--config is required, e.g. --config configs/llama3_70b.py")
    if args.audit and args.no_compile:
        fail("--audit reads the compiled step: drop --no-compile")
    if args.doc_len < 0:
        fail(f"--doc-len must be a positive token count, got {args.doc_len}")
    if args.max_context < 0:
        fail(f"--max-context must be >= 0 (1: no context parallelism), got {args.max_context}")
    try:
        cluster = Cluster(args.gpu.lower(), args.nodes, args.gpus_per_node)
        cfg = load_config(args.config, args.overrides)
        if args.doc_len and not cfg.data.masks_documents:
            fail("--doc-len: this step has no documents to mask (data.source="
                 f"{cfg.data.source!r}, data.document_masking={cfg.data.document_masking}); "
                 "plan with --set data.source=FOLDER (a launch.prepare_data folder; it need not "
                 "exist to plan) and data.document_masking=true")
        with assume_document_tokens(args.doc_len or None):
            plan = make_plan(cfg, cluster, compile_step=not args.no_compile,
                             search=args.search, verify=args.verify, buffers=args.buffers,
                             max_context=args.max_context, audit=args.audit)
    except (PlanError, ConfigError) as e:
        fail(str(e))
    out = pathlib.Path(args.out or f"runs/plan-{pathlib.Path(args.config).stem}-"
                                   f"{cluster.gpu}x{cluster.n_gpus}")
    plan["config_file"] = str(args.config)
    plan["overrides"] = list(args.overrides)
    print(format_plan(plan))
    write_json(plan, out / "plan.json")
    if "params" in plan:
        render(plan, out / "plan.png")
        print(f"wrote {out / 'plan.json'} and {out / 'plan.png'}")
    else:
        print(f"wrote {out / 'plan.json'} (no layout fits, so no plan.png)", file=sys.stderr)
        raise SystemExit(1)
    if args.audit:
        _audit_exit(plan)


def _audit_exit(plan: dict) -> None:
    """Exit 1 with one line per audit finding (or why there is no audit)."""
    audit = plan.get("audit")
    if audit is None:
        error = (plan.get("compile") or {}).get("error", "")
        fail("audit: no compiled step to audit" + (f" (compile failed: {error[:300]})"
                                                   if error else ""))
    if "skipped" in audit:
        fail(f"audit: not done: {audit['skipped']}")
    for line in audit["findings"]:
        print(f"AUDIT: {line}", file=sys.stderr)
    if audit["findings"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
