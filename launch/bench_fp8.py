"""python -m launch.bench fp8 [--tokens N] [--scale S] [--impls ...] [--iters N] [--out FILE]

TFLOP/s of the FP8 matmul implementations against XLA's own FP8 dot and the bf16 matmul at
the Llama-70B GEMM shapes: tokens x (8192 -> 8192), (8192 -> 28672), (28672 -> 8192).
FLOPs per GEMM = 2 * M * N * K (M tokens, K in, N out); TFLOP/s = that / median time.
Operands are quantized once before timing: the numbers are the GEMM alone (the quantizers are
elementwise passes XLA fuses into the producers). One run prints a table and writes JSON.

impls: bf16 (jnp.dot, bf16 in, f32 accumulate, bf16 out), xla_fp8 (tensorwise e4m3 dot through
XLA: cuBLASLt on Hopper), sm90 (our wgmma kernel, tensorwise), xla_mx (jax.nn.scaled_matmul,
MXFP8: cuDNN on Blackwell), sm100 (our block-scaled tcgen05 kernel, MXFP8), pallas_grid (the
portable grid kernel; interpret mode on CPU, so only with a large --scale). Default: what the
platform runs (GPU sm_90: bf16 xla_fp8 sm90; sm_100: bf16 xla_fp8 xla_mx sm100; CPU: bf16
xla_fp8).
`--scale S` divides every dimension by S (a CPU smoke run: --scale 32).
"""

from __future__ import annotations

import argparse
import json
import sys

from titanax.perf.timing import median_call_seconds

SHAPES = [(8192, 8192), (8192, 28672), (28672, 8192)]  # (K in, N out) of Llama-3-70B's GEMMs


def _default_impls() -> list[str]:
    from pallas_kernels.target import compute_capability

    cc = compute_capability()
    if cc is None:
        return ["bf16", "xla_fp8"]
    major = cc[0]
    return ["bf16", "xla_fp8", "sm90"] if major == 9 else ["bf16", "xla_fp8", "xla_mx", "sm100"]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.bench fp8", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="M: tokens per GEMM")
    p.add_argument("--scale", type=int, default=1, help="divide every dimension by this")
    p.add_argument("--impls", nargs="+", default=None,
                   choices=["bf16", "xla_fp8", "sm90", "xla_mx", "sm100", "pallas_grid"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="fp8_bench.json")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from pallas_kernels.fp8 import fp8_matmul, quantize_mxfp8, quantize_tensorwise

    impls = args.impls or _default_impls()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}); impls: {', '.join(impls)}; "
          f"FLOPs = 2*M*N*K; median of {args.iters}")
    rows = []
    for k, n in SHAPES:
        m, k, n = args.tokens // args.scale, k // args.scale, n // args.scale
        ka, kb = jax.random.split(jax.random.key(0))
        a = jax.random.normal(ka, (m, k), jnp.bfloat16)
        b = (jax.random.normal(kb, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        qa, sa = jax.jit(quantize_tensorwise)(a)
        qb, sb = jax.jit(quantize_tensorwise)(b)
        ma, msa = jax.jit(lambda x: quantize_mxfp8(x, axis=1))(a)
        mb, msb = jax.jit(lambda x: quantize_mxfp8(x, axis=0))(b)
        cases = {
            "bf16": (jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)
                             .astype(jnp.bfloat16)), (a, b)),
            "xla_fp8": (jax.jit(lambda *t: fp8_matmul(*t, impl="xla")), (qa, sa, qb, sb)),
            "sm90": (jax.jit(lambda *t: fp8_matmul(*t, impl="sm90")), (qa, sa, qb, sb)),
            "xla_mx": (jax.jit(lambda *t: fp8_matmul(*t, impl="xla")), (ma, msa, mb, msb)),
            "sm100": (jax.jit(lambda *t: fp8_matmul(*t, impl="sm100")), (ma, msa, mb, msb)),
            "pallas_grid": (jax.jit(lambda *t: fp8_matmul(*t, impl="pallas_grid",
                                                          interpret=dev.platform == "cpu")),
                            (qa, sa, qb, sb)),
        }
        flops = 2.0 * m * n * k
        base = None
        for impl in impls:
            fn, fargs = cases[impl]
            try:
                sec = median_call_seconds(fn, fargs, args.iters)
            except Exception as e:  # noqa: BLE001 - report and go on: one table, one run
                print(f"  {impl} at {m}x{k}->{n} failed: {type(e).__name__}: {str(e)[:200]}",
                      file=sys.stderr)
                rows.append({"m": m, "k": k, "n": n, "impl": impl, "error": str(e)[:500]})
                continue
            tflops = flops / sec / 1e12
            base = tflops if impl == "bf16" else base
            rows.append({"m": m, "k": k, "n": n, "impl": impl, "ms": sec * 1e3,
                         "tflops": tflops, "vs_bf16": tflops / base if base else None})
    print(f"{'M x K -> N':>24} {'impl':>12} {'ms':>10} {'TFLOP/s':>10} {'x bf16':>8}")
    for r in rows:
        shape = f"{r['m']} x {r['k']} -> {r['n']}"
        if "error" in r:
            print(f"{shape:>24} {r['impl']:>12} {'failed':>10}")
            continue
        vs = f"{r['vs_bf16']:.2f}" if r["vs_bf16"] else "-"
        print(f"{shape:>24} {r['impl']:>12} {r['ms']:10.3f} {r['tflops']:10.2f} {vs:>8}")
    with open(args.out, "w") as f:
        json.dump({"device": dev.device_kind, "platform": dev.platform, "tokens": args.tokens,
                   "scale": args.scale, "iters": args.iters, "flops": "2*M*N*K",
                   "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
