"""python -m launch.gpu_check [--dry-run] [--sections a,b,...] [--out DIR] [--time-limit S]

One prepared command for a short GPU loan (docs/gpu_check.md): device facts, ptxas reports,
kernels against their references on the device, attention and FP8 GEMM throughput at
Llama-3-70B shapes, and the 70B-shaped train step's tokens/s and MFU per matmul recipe. Each
section runs in its own process under a time budget; OUT/gpu_check.json and OUT/gpu_check.md
are rewritten after every section. --dry-run runs the same code on tiny shapes on the CPU (the
Pallas interpreters), as CI does. Exit status 0 when every section is ok or skipped.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from launch.common import fail
from titanax.perf.gpu_check import DEFAULT_TIME_LIMIT_S, NAMES, run, run_worker


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m launch.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU, in the Pallas interpreters (CI)")
    p.add_argument("--sections", default=",".join(NAMES),
                   help=f"comma list, run in this order: {','.join(NAMES)}")
    p.add_argument("--out", default="runs/gpu_check", help="gpu_check.json, gpu_check.md, logs/")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help="seconds for the whole run; section budgets scale with it")
    p.add_argument("--cache-dir", default=None,
                   help="persistent compilation cache, so a rerun skips compiles (GPU default "
                        "runs/jax_cache, dry run none; '' turns it off)")
    # The runner starts each section as `--worker NAME --worker-fn MODULE:FUNC` in a child.
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-fn", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=600.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        raise SystemExit(run_worker(args.worker, args.worker_fn, args.out, dry_run=args.dry_run,
                                    budget_s=args.budget, cache_dir=args.cache_dir))
    names = [s for s in args.sections.split(",") if s]
    unknown = [s for s in names if s not in NAMES]
    if unknown or not names:
        fail(f"--sections: unknown {unknown}; choose from {','.join(NAMES)}")
    if args.time_limit <= 0:
        fail("--time-limit must be > 0")
    cache = args.cache_dir if args.cache_dir is not None else (
        None if args.dry_run else "runs/jax_cache")
    rep = run(names, args.out, dry_run=args.dry_run, time_limit_s=args.time_limit,
              cache_dir=cache or None,
              command="python -m launch.gpu_check " + shlex.join(argv))
    statuses = {n: s["status"] for n, s in rep["sections"].items()}
    print(f"wrote {rep['out']}/gpu_check.json and gpu_check.md: {statuses}")
    raise SystemExit(0 if all(s in ("ok", "skipped") for s in statuses.values()) else 1)


if __name__ == "__main__":
    from launch.common import use_tcmalloc

    use_tcmalloc()
    main()
