"""Sections 4 and 5: attention and FP8 GEMM throughput at Llama-3-70B shapes, measured by the
benchmarks' own code (pallas_kernels/flash_attention/bench.py, pallas_kernels/fp8/bench.py,
which launch/bench_attention.py and launch/bench_fp8.py run), so gpu_check and
`python -m launch.bench` report the same numbers for the same case.

Attention (FlashAttention papers' count): fwd FLOPs = 4*B*S^2*Hq*D / 2 (causal), bwd = 2.5 x
fwd; the backward time is (fwd+bwd) - fwd, medians of timed calls. Our kernel for this GPU
against cuDNN, Hq 64 / Hkv 8 / D 128, bf16, B = tokens // S. "With segment ids" passes one
document per sequence, as launch.bench train's batches and unpacked data do: the FLOPs are the
same, so the column prices the segment-id path itself (cuDNN takes it as a dense S x S mask).
GEMMs: FLOPs = 2*M*N*K at M = 8192 tokens and (K, N) = (8192, 8192), (8192, 28672),
(28672, 8192); TFLOP/s = FLOPs / median time, operands quantized before timing.
"""

from __future__ import annotations

from pallas_kernels.flash_attention import bench as bench_attention
from pallas_kernels.fp8 import bench as bench_fp8
from pallas_kernels.fp8.backends import SCALINGS, generation_kernels
from pallas_kernels.target import compute_capability
from titanax.perf.gpu_check.device import our_attention_impl

# (seqs, tokens per call, iters): the GPU run, and the dry run's tiny twin. The training
# length first: a budget that runs short drops the others.
ATTN_PLAN = {False: ((8192, 4096, 16384, 2048), 16384, 10), True: ((256, 128), 256, 2)}


def attention_section(ctx) -> None:
    seqs, tokens, iters = ATTN_PLAN[ctx.dry_run]
    # The dry run cannot time kernels in an interpreter: xla stands in for our kernel there.
    ours = "xla" if ctx.dry_run else our_attention_impl()
    ctx.note(ours=ours, baseline="cudnn", tokens_per_call=tokens, iters=iters,
             heads=f"{bench_attention.HQ}/{bench_attention.HKV}", head_dim=bench_attention.D,
             flops="fwd = 4*B*S^2*Hq*D / 2 (causal); bwd = 2.5*fwd; TFLOP/s = FLOPs / median")
    for S in seqs:
        B = max(1, tokens // S)
        for segments in (False, True):
            base = None
            for impl in ("cudnn", ours):  # cuDNN first: our row carries the ratio to it
                label = {"impl": impl, "seq": S, "batch": B, "segments": segments}

                def measure(impl=impl, B=B, S=S, segments=segments, base=base):
                    row = bench_attention.bench_one(impl, B, S, causal=True, iters=iters,
                                                    segments=segments)
                    if base and "fwd_tflops" in base:
                        row["fwd_vs_cudnn"] = row["fwd_tflops"] / base["fwd_tflops"]
                        row["bwd_vs_cudnn"] = row["bwd_tflops"] / base["bwd_tflops"]
                    return row
                row = ctx.run_item(label, measure, estimate_s=6.0, group="attention")
                base = row if impl == "cudnn" else base


def _fp8_impls(dry: bool) -> list[str]:
    """Explicit impl names (never a default that may change): ours and XLA's, bf16 and FP8."""
    if dry:
        return ["bf16", "xla_fp8", "xla_mx", "pallas_grid"]  # the grid kernel, interpreted
    major = (compute_capability() or (0, 0))[0]
    ours = [m.name for s in SCALINGS for m in generation_kernels(major, s)]
    # Hopper has no MX hardware: xla_mx there is XLA's own lowering, kept for the record.
    return ["bf16", "xla_fp8", "xla_mx"] + ours


def fp8_section(ctx) -> None:
    impls = _fp8_impls(ctx.dry_run)
    kw = dict(tokens=8192, scale=64 if ctx.dry_run else 1, iters=2 if ctx.dry_run else 20)
    argv = (f"--tokens {kw['tokens']} --iters {kw['iters']} --impls {' '.join(impls)}"
            + (f" --scale {kw['scale']}" if ctx.dry_run else ""))  # the launch.bench fp8 twin
    ctx.note(impls=impls, argv=argv, flops="2*M*N*K; TFLOP/s = FLOPs / median time")
    data = bench_fp8.run(impls=impls, **kw)
    ctx.note(device=data["device"], scale=data["scale"])
    by_shape: dict[tuple, dict] = {}
    for r in data["rows"]:
        by_shape.setdefault((r["m"], r["k"], r["n"]), {})[r["impl"]] = r
    for r in data["rows"]:
        base = by_shape[(r["m"], r["k"], r["n"])].get("xla_fp8", {}).get("tflops")
        if "tflops" in r and base:
            r["vs_xla_fp8"] = r["tflops"] / base
        ctx.add(r)
