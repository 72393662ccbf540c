"""python -m launch.bench fp8 [--tokens N] [--scale S] [--impls ...] [--iters N] [--out FILE]

TFLOP/s of the FP8 matmul implementations against XLA's own FP8 dot and the bf16 matmul at
the Llama-70B GEMM shapes; the measuring code, the cases and the FLOP count are
pallas_kernels/fp8/bench.py's. One run prints a table and writes JSON.
`--scale S` divides every dimension by S (a CPU smoke run: --scale 32).
"""

from __future__ import annotations

import argparse
import json

from pallas_kernels.fp8.bench import CASES


def _print_table(rows: list[dict]) -> None:
    print(f"{'M x K -> N':>24} {'impl':>12} {'ms':>10} {'TFLOP/s':>10} {'x bf16':>8}")
    for r in rows:
        shape = f"{r['m']} x {r['k']} -> {r['n']}"
        if "error" in r:
            print(f"{shape:>24} {r['impl']:>12} {'failed':>10}")
            continue
        vs = f"{r['vs_bf16']:.2f}" if r["vs_bf16"] else "-"
        print(f"{shape:>24} {r['impl']:>12} {r['ms']:10.3f} {r['tflops']:10.2f} {vs:>8}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.bench fp8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="M: tokens per GEMM")
    p.add_argument("--scale", type=int, default=1, help="divide every dimension by this")
    p.add_argument("--impls", nargs="+", default=None, choices=list(CASES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="fp8_bench.json")
    args = p.parse_args(argv)

    from pallas_kernels.fp8.bench import default_impls, run

    impls = args.impls or default_impls()
    print(f"impls: {', '.join(impls)}; FLOPs = 2*M*N*K; median of {args.iters}")
    data = run(args.tokens, args.scale, impls, args.iters)
    print(f"device: {data['device']} ({data['platform']})")
    _print_table(data["rows"])
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
