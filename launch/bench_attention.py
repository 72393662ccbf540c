"""python -m launch.bench attention: forward and backward TFLOP/s of every available flash
attention backend at Llama-3-70B attention shapes (64 q heads, 8 kv heads, head_dim 128,
causal, bf16), a table on stdout and JSON in --out. The measuring code and the FLOP counts are
pallas_kernels/flash_attention/bench.py's.

    python -m launch.bench attention [--seqs 1024,2048,4096,8192,16384] [--tokens 16384]
        [--impls mosaic_sm90,mosaic_sm100,triton,cudnn,xla] [--iters 10]
        [--out runs/bench_attention.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax

from pallas_kernels.flash_attention.bench import HKV, HQ, D, bench_row, default_impls, header


def _print_row(row: dict) -> None:
    lead = f"{row['impl']:<12} {row['batch']:>3} {row['seq']:>6}"
    if "error" in row:
        print(f"{lead} error: {row['error'][:80]}", flush=True)
        return
    print(f"{lead} {row['fwd_ms']:>9.3f} {row['bwd_ms']:>9.3f} {row['fwd_tflops']:>9.2f} "
          f"{row['bwd_tflops']:>9.2f} {row['fwd_bwd_tflops']:>9.2f}", flush=True)


def main(argv=None):
    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(prog="python -m launch.bench attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384" if on_gpu else "256,512")
    p.add_argument("--tokens", type=int, default=16384 if on_gpu else 512,
                   help="batch = max(1, tokens // seq)")
    p.add_argument("--impls", default=None, help="comma list (default: all available here)")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--iters", type=int, default=10 if on_gpu else 2)
    p.add_argument("--out", default="runs/bench_attention.json")
    args = p.parse_args(argv)
    impls = args.impls.split(",") if args.impls else default_impls()
    causal = not args.no_causal
    info = header(causal)
    print(f"device: {info['device']} ({info['backend']}); Hq={HQ} Hkv={HKV} D={D} "
          f"bf16 causal={causal}")
    print("FLOPs (FlashAttention papers): fwd = 4*B*S^2*Hq*D" + (" / 2 (causal)" if causal else "")
          + ", bwd = 2.5 * fwd")
    print(f"{'impl':<12} {'B':>3} {'seq':>6} {'fwd ms':>9} {'bwd ms':>9} {'fwd TF/s':>9} "
          f"{'bwd TF/s':>9} {'f+b TF/s':>9}")
    rows = []
    for S in (int(s) for s in args.seqs.split(",")):
        B = max(1, args.tokens // S)
        for impl in impls:
            rows.append(bench_row(impl, B, S, causal=causal, iters=args.iters))
            _print_row(rows[-1])
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**info, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
