"""python -m launch.bench attention: forward and backward TFLOP/s of every available flash
attention backend at Llama-3-70B attention shapes (64 q heads, 8 kv heads, head_dim 128,
causal, bf16), a table on stdout and JSON in --out.

FLOPs are counted as the FlashAttention papers count them: forward = 4 * B * S^2 * Hq * D
(QK^T and PV, 2 FLOPs per multiply-add), halved when causal; backward = 2.5 x forward (five
matmuls instead of two; the recomputation of QK^T is not counted as useful work). The backward
time is (forward+backward) - forward, each the median of --iters timed calls after warm-up.

    python -m launch.bench attention [--seqs 1024,2048,4096,8192,16384] [--tokens 16384]
        [--impls mosaic_sm90,mosaic_sm100,triton,cudnn,xla] [--iters 10]
        [--out runs/bench_attention.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.flash_attention.api import mosaic_unsupported
from titanax.perf.timing import median_call_seconds

HQ, HKV, D = 64, 8, 128


def attention_flops(B, S, Hq, D, *, causal):
    fwd = 4 * B * S * S * Hq * D // (2 if causal else 1)
    return fwd, 2.5 * fwd


def _default_impls():
    if jax.default_backend() != "gpu":
        return ["xla", "cudnn"]  # interpret-mode kernels measure the interpreter, not a kernel
    from pallas_kernels.target import compute_capability

    major = (compute_capability() or (0, 0))[0]
    impls = {9: ["mosaic_sm90"], 10: ["mosaic_sm100"]}.get(major, [])
    return impls + ["triton", "cudnn", "xla"]


def bench_one(impl, B, S, *, causal, iters, segments: bool = False):
    """One row. segments: packed-document segment ids (one document per sequence, so the
    FLOP count is unchanged) through the kernels' segment path."""
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, S, HQ, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, S, HKV, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, S, HKV, D), jnp.bfloat16)
    seg = jnp.zeros((B, S), jnp.int32) if segments else None
    attn = lambda q, k, v, s: flash_attention(q, k, v, causal=causal, segment_ids=s, impl=impl)
    fwd = jax.jit(attn)
    fwd_bwd = jax.jit(jax.grad(lambda q, k, v, s: attn(q, k, v, s).astype(jnp.float32).sum(),
                               argnums=(0, 1, 2)))
    t_fwd = median_call_seconds(fwd, (q, k, v, seg), iters)
    t_all = median_call_seconds(fwd_bwd, (q, k, v, seg), iters)
    f_fwd, f_bwd = attention_flops(B, S, HQ, D, causal=causal)
    t_bwd = max(t_all - t_fwd, 1e-9)
    return {"impl": impl, "batch": B, "seq": S, "causal": causal, "segments": segments,
            "fwd_ms": t_fwd * 1e3,
            "bwd_ms": t_bwd * 1e3, "fwd_tflops": f_fwd / t_fwd / 1e12,
            "bwd_tflops": f_bwd / t_bwd / 1e12, "fwd_bwd_tflops": (f_fwd + f_bwd) / t_all / 1e12}


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
    impls = args.impls.split(",") if args.impls else _default_impls()
    causal = not args.no_causal
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}); Hq={HQ} Hkv={HKV} D={D} "
          f"bf16 causal={causal}")
    print("FLOPs (FlashAttention papers): fwd = 4*B*S^2*Hq*D" + (" / 2 (causal)" if causal else "")
          + ", bwd = 2.5 * fwd")
    print(f"{'impl':<12} {'B':>3} {'seq':>6} {'fwd ms':>9} {'bwd ms':>9} {'fwd TF/s':>9} "
          f"{'bwd TF/s':>9} {'f+b TF/s':>9}")
    rows = []
    for S in (int(s) for s in args.seqs.split(",")):
        B = max(1, args.tokens // S)
        for impl in impls:
            why = mosaic_unsupported(impl, jnp.bfloat16, D) if impl.startswith("mosaic") else None
            try:
                if why:
                    raise ValueError(why)
                row = bench_one(impl, B, S, causal=causal, iters=args.iters)
                print(f"{impl:<12} {B:>3} {S:>6} {row['fwd_ms']:>9.3f} {row['bwd_ms']:>9.3f} "
                      f"{row["fwd_tflops"]:>9.2f} {row["bwd_tflops"]:>9.2f} "
                      f"{row["fwd_bwd_tflops"]:>9.2f}", flush=True)
            except Exception as e:  # one backend failing (OOM, unsupported) must not stop the rest
                row = {"impl": impl, "batch": B, "seq": S, "causal": causal,
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
                print(f"{impl:<12} {B:>3} {S:>6} error: {row['error'][:80]}", flush=True)
            rows.append(row)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": dev.device_kind, "backend": jax.default_backend(),
                               "jax": jax.__version__, "q_heads": HQ, "kv_heads": HKV,
                               "head_dim": D, "dtype": "bfloat16", "causal": causal,
                               "flops": "fwd = 4*B*S^2*Hq*D (/2 causal); bwd = 2.5*fwd",
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
