"""python -m launch.gpu_check [--dry-run] [--sections a,b,...] [--out DIR] [--pack DIR]
                              [--time-limit S]

Everything a short GPU loan should measure (docs/gpu_check.md; a loan runs it through
scripts/gpu_loan.sh): device facts, kernels against their references on the device, the
70B-shaped train step's tokens/s and MFU (cuDNN attention first, then ours, per matmul recipe),
attention and FP8 GEMM throughput at Llama-3-70B shapes, each kernel choice made without a GPU
against its alternative; ptxas reports on request. --apply RESULTS writes a returned
gpu_check.json into docs/ and pallas_kernels/measured.py instead of running anything. Each
section runs in its own process under a time budget; OUT/gpu_check.json and OUT/gpu_check.md
are rewritten after every section, and a kernel that failed or hung is skipped by the later
sections. --pack DIR: also gpu_check.json, gpu_check.md and logs.tar.gz in DIR after every
section. --dry-run runs the same code on tiny shapes on the CPU (the Pallas interpreters), as
CI does. --preflight: the loan's first step (packages, jax version, a GPU), nothing else.
Exit status 0 when every section is ok or skipped.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from launch.common import fail
from titanax.perf.gpu_check import DEFAULT_ORDER, DEFAULT_TIME_LIMIT_S, NAMES, run, run_worker


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m launch.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU, in the Pallas interpreters (CI)")
    p.add_argument("--sections", default=",".join(DEFAULT_ORDER),
                   help=f"comma list, run in the order given, of {','.join(NAMES)} "
                        f"(default {','.join(DEFAULT_ORDER)})")
    p.add_argument("--out", default="runs/gpu_check", help="gpu_check.json, gpu_check.md, logs/")
    p.add_argument("--pack", default=None,
                   help="also keep gpu_check.json, gpu_check.md and logs.tar.gz here (a loan's "
                        "$OUT: at most 8 files come back)")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help="seconds for the whole run; section budgets scale with it")
    p.add_argument("--cache-dir", default=None,
                   help="persistent compilation cache, so a rerun skips compiles (GPU default "
                        "runs/jax_cache, dry run none; '' turns it off)")
    p.add_argument("--preflight", action="store_true",
                   help="only check that the packages import, jax is the pinned version and "
                        "(without --dry-run) jax has a GPU; on a refusal one error: line, "
                        "gpu_check.json/.md saying why (also in --pack), exit 3 (2: a package "
                        "does not import). scripts/gpu_loan.sh runs it first")
    p.add_argument("--apply", default=None, metavar="RESULTS",
                   help="write a returned gpu_check.json into docs/bench/, docs/performance.md "
                        "and pallas_kernels/measured.py (titanax.perf.gpu_check.apply); runs "
                        "nothing")
    # The runner starts each section as `--worker NAME --worker-fn MODULE:FUNC` in a child.
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-fn", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=600.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.apply:
        import pathlib

        from titanax.perf.gpu_check.apply import ApplyError, apply
        try:
            written = apply(pathlib.Path(args.apply), pathlib.Path(__file__).resolve().parents[1])
        except ApplyError as e:
            fail(f"--apply: {e}")
        print("wrote " + ", ".join(str(p) for p in written))
        return
    if args.preflight:
        import pathlib

        from titanax.perf.gpu_check.preflight import preflight
        code, error, facts = preflight(
            dry_run=args.dry_run, out_dir=pathlib.Path(args.out),
            pack_dir=pathlib.Path(args.pack) if args.pack else None,
            command="python -m launch.gpu_check " + shlex.join(argv))
        if error:
            fail(error, code)
        print(f"preflight ok: {facts.get('device_kind', 'dry run, no GPU probe')}"
              + (f" ({facts['backend_start_s']} s to start the backend)"
                 if "backend_start_s" in facts else ""))
        for row in facts.get("versions", []):
            if row["status"] != "ok":
                print(f"warning: {row['reason']}")
        return
    if args.worker:
        raise SystemExit(run_worker(args.worker, args.worker_fn, args.out, dry_run=args.dry_run,
                                    budget_s=args.budget, cache_dir=args.cache_dir))
    names = [s for s in args.sections.split(",") if s]
    unknown = [s for s in names if s not in NAMES]
    if unknown or not names or len(set(names)) < len(names):
        fail(f"--sections: unknown {unknown} or repeated; choose from {','.join(NAMES)}")
    if args.time_limit <= 0:
        fail("--time-limit must be > 0")
    cache = args.cache_dir if args.cache_dir is not None else (
        None if args.dry_run else "runs/jax_cache")
    rep = run(names, args.out, dry_run=args.dry_run, time_limit_s=args.time_limit,
              cache_dir=cache or None, pack_dir=args.pack,
              command="python -m launch.gpu_check " + shlex.join(argv))
    statuses = {n: s["status"] for n, s in rep["sections"].items()}
    print(f"wrote {rep['out']}/gpu_check.json and gpu_check.md: {statuses}")
    raise SystemExit(0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1)


if __name__ == "__main__":
    from launch.common import use_tcmalloc

    use_tcmalloc()
    main()
