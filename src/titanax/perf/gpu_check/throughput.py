"""Sections 4 and 5: attention and FP8 GEMM throughput at Llama-3-70B shapes, measured by the
benchmarks' own code (pallas_kernels/flash_attention/bench.py, pallas_kernels/fp8/bench.py,
which launch/bench_attention.py and launch/bench_fp8.py run), so gpu_check and
`python -m launch.bench` report the same numbers for the same case.

Attention times the exact call the model makes (titanax.ops.attention with the shipped
presets' execution.attention_impl, 'auto', causal, Hq 64 / Hkv 8 / D 128, bf16, B = tokens // S),
without documents and with 2,048-token documents packed into each window, against cuDNN's
causal kernel (CAUSAL mask type, no documents), and our kernel for this GPU named explicitly.
FLOPs (FlashAttention papers' count): fwd = 4*B*S^2*Hq*D / 2 (causal); with documents only
the visible pairs, 4*B*Hq*D*sum L(L+1)/2; bwd = 2.5 x fwd; the backward time is
(fwd+bwd) - fwd, medians of timed calls. `vs_cudnn_causal`: cuDNN causal's time over this
row's (> 1: faster than plain causal attention on cuDNN).
GEMMs: FLOPs = 2*M*N*K at M = 8192 tokens and (K, N) = (8192, 8192), (8192, 28672),
(28672, 8192); TFLOP/s = FLOPs / median time, operands quantized before timing.
"""

from __future__ import annotations

from pallas_kernels.flash_attention import bench as bench_attention
from pallas_kernels.fp8 import bench as bench_fp8
from pallas_kernels.target import compute_capability
from titanax.perf.gpu_check.context import attention_key, fp8_key
from titanax.perf.gpu_check.device import our_attention_impl
from titanax.perf.gpu_check.generation import fp8_refusal

# (seqs, tokens per call, iters): the GPU run, and the dry run's tiny twin. The training
# length first: a budget that runs short drops the others.
ATTN_PLAN = {False: ((8192, 4096, 16384, 2048), 16384, 10), True: ((256,), 256, 2)}
# Tokens per packed document in the "documents" rows (the dry run's windows are shorter).
DOC_TOKENS = {False: 2048, True: 64}
MODEL_IMPL = "auto"  # configs/llama3_*.py execution.attention_impl (titanax/recipes.py)


def model_attention(impl: str):
    """The model's attention call (models/common/block.py DecoderBlock.attention -> titanax.ops.attention)."""
    from titanax import ops
    return lambda q, k, v, seg: ops.attention(q, k, v, impl=impl, causal=True,
                                              segment_ids=seg)


def _attention_cases(ours: str, dry: bool):
    """(label impl, attend or None for flash_attention, documents) in measuring order: cuDNN
    causal first, the baseline every later row is compared with."""
    model = f"model:{MODEL_IMPL}"
    return [("cudnn", None, False),
            (model, model_attention("xla" if dry else MODEL_IMPL), False),
            (model, model_attention("xla" if dry else MODEL_IMPL), True),
            (ours, None, True), (ours, None, False)]


def attention_section(ctx) -> None:
    seqs, tokens, iters = ATTN_PLAN[ctx.dry_run]
    doc = DOC_TOKENS[ctx.dry_run]
    # The dry run cannot time kernels in an interpreter: xla stands in for our kernel there.
    ours = "xla" if ctx.dry_run else our_attention_impl()
    ctx.note(ours=ours, model_call=f"titanax.ops.attention(impl={MODEL_IMPL!r})",
             baseline="cudnn causal", tokens_per_call=tokens, iters=iters, doc_tokens=doc,
             heads=f"{bench_attention.HQ}/{bench_attention.HKV}", head_dim=bench_attention.D,
             flops="fwd = 4*B*S^2*Hq*D / 2 (causal), documents: visible pairs only; "
                   "bwd = 2.5*fwd; TFLOP/s = FLOPs / median")
    for S in seqs:
        B = max(1, tokens // S)
        base = None
        for impl, attend, documents in _attention_cases(ours, ctx.dry_run):
            label = {"impl": impl, "seq": S, "batch": B, "documents": documents}

            def measure(impl=impl, attend=attend, documents=documents, base=base, B=B, S=S):
                row = bench_attention.bench_one(
                    impl if attend is None else "cudnn", B, S, causal=True, iters=iters,
                    segments=documents, doc_tokens=doc if documents else 0, attend=attend)
                row["impl"] = impl
                if base and "fwd_ms" in base:
                    row["vs_cudnn_causal"] = ((base["fwd_ms"] + base["bwd_ms"])
                                              / (row["fwd_ms"] + row["bwd_ms"]))
                return row
            # model:auto runs cuDNN causal without documents and our kernel with them
            # (resolve.py), in the dry run xla.
            runs = impl if attend is None else ("xla" if ctx.dry_run else
                                                ours if documents else "cudnn")
            row = ctx.run_item(label, measure, estimate_s=6.0, group="attention",
                               uses=(attention_key(runs, documents),))
            base = row if base is None else base


def fp8_impls(cc: tuple[int, int] | None, dry: bool) -> tuple[list[str], dict]:
    """Explicit case names (never a default that may change): ours and XLA's, bf16 and FP8;
    and {case: reason} for those this GPU generation cannot run (generation.fp8_refusal:
    before Blackwell no MX GEMM runs in hardware, and titanax refuses mxfp8 there)."""
    if dry:  # the grid kernel, interpreted
        return ["bf16", "xla_fp8", "xla_rowwise", "xla_mx", "pallas_grid"], {}
    cases = ["bf16", "xla_fp8", "xla_rowwise", "xla_mx", *bench_fp8.KERNEL_CASES]
    na = {}
    for case in cases:
        impl, mode = bench_fp8.case_kernel(case)
        if impl is not None and (why := fp8_refusal(impl, mode, cc)):
            na[case] = why
    return [c for c in cases if c not in na], na


def _fp8_uses(case: str) -> tuple:
    impl, mode = bench_fp8.case_kernel(case)
    return () if impl is None else (fp8_key(impl, mode),)


def fp8_section(ctx) -> None:
    impls, na = fp8_impls(None if ctx.dry_run else compute_capability(), ctx.dry_run)
    skipped = {i: "; ".join(ctx.suspects[u] for u in _fp8_uses(i) if u in ctx.suspects)
               for i in impls}
    run = [i for i in impls if not skipped[i]]
    kw = dict(tokens=8192, scale=64 if ctx.dry_run else 1, iters=2 if ctx.dry_run else 20)
    argv = (f"--tokens {kw['tokens']} --iters {kw['iters']} --impls {' '.join(run)}"
            + (f" --scale {kw['scale']}" if ctx.dry_run else ""))  # the launch.bench fp8 twin
    ctx.note(impls=impls, argv=argv, flops="2*M*N*K; TFLOP/s = FLOPs / median time")
    for case, why in na.items():
        ctx.add({"impl": case, "status": "n/a", "reason": why})
    for impl in impls:
        if skipped[impl]:
            ctx.add({"impl": impl, "status": "skipped", "reason": skipped[impl]})
    xla_fp8: dict[tuple, float] = {}

    def on_row(r: dict) -> None:  # saved as each GEMM finishes: a timeout keeps the rest
        shape = (r["m"], r["k"], r["n"])
        if r["impl"] == "xla_fp8" and "tflops" in r:
            xla_fp8[shape] = r["tflops"]
        if "tflops" in r and xla_fp8.get(shape):
            r["vs_xla_fp8"] = r["tflops"] / xla_fp8[shape]
        ctx.add({**r, "uses": list(_fp8_uses(r["impl"]))})
    data = bench_fp8.run(impls=run, on_row=on_row, **kw)
    ctx.note(device=data["device"], scale=data["scale"])
