"""Section 3: our kernels against their jnp references on the device, values and gradients, at
the shipped block configs (flash_attention's default_config, the fp8 dataclasses' defaults).

Flash attention: each impl at head_dim 64/128/256, causal, GQA (8 query heads per kv head on
the GPU, as Llama-3-70B), with and without packed-document segment ids; output and dq, dk, dv
against the reference (flash_attention/backend_xla.py) run in float32 on the same bf16 inputs.
Error per tensor = max|x - ref| / max|ref|, passing under 2e-2 (about backend_suite_test.py's
bf16 tolerance).
FP8 matmul: each impl and scaling mode against reference.py (float32 upcast-and-dot) on the
same quantized operands; bf16 output within rtol 8e-3 and atol 8e-3 * max|ref| (test_sm90.py,
test_matmul.py). Only the float32 summation order and the final bf16 rounding may differ.

Dry run: tiny shapes in the Pallas interpreters (Triton-style grid kernels with interpret=True,
the Mosaic GPU kernels in plgpu's interpreter at head_dim 64 with segment ids, ~5 s a case).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_attention import attention_reference, flash_attention
from pallas_kernels.flash_attention.backends import GPU_FALLBACK, GPU_VENDOR, KERNEL_IMPLS, backend
from pallas_kernels.flash_attention.check import (
    ATTN_TOL,
    errors,
    normal,
    packed_segments,
    verdict,
    vjp_fn,
)
from pallas_kernels.flash_attention.resolve import our_kernel, unsupported
from pallas_kernels.fp8 import fp8_matmul, quantize_mxfp8, quantize_rowwise, quantize_tensorwise
from pallas_kernels.fp8.config import E4M3, Sm90Config, Sm100Config
from pallas_kernels.fp8.matmul_sm90 import supported as sm90_supported
from pallas_kernels.fp8.matmul_sm100 import supported as sm100_supported
from pallas_kernels.fp8.reference import fp8_matmul_reference
from pallas_kernels.target import compute_capability
from titanax.perf.gpu_check.context import attention_key, fp8_key
from titanax.perf.gpu_check.generation import attention_refusal, fp8_refusal

FP8_TOL = 8e-3  # bf16 output, test_sm90.py / test_matmul.py
# Every GPU generation's kernel (n/a off its generation), the portable one, and cuDNN.
ATTN_IMPLS = (*(n for n in KERNEL_IMPLS if backend(n).compute_capability), GPU_FALLBACK,
              GPU_VENDOR)
HEAD_DIMS = (128, 64, 256)  # 70B's first: a budget that runs short drops the others
TIMED_HEAD_DIM = 128  # what the attention and train sections run
# (B, S, Hq, Hkv): S off the block grid, so padding and key tails are checked too.
ATTN_SHAPE = {False: (2, 1000, 16, 2), True: (1, 100, 2, 1)}
FP8_SHAPES = {False: [(1024, 2048, 1536), (8192, 8192, 8192)], True: [(128, 256, 256)]}


def _attn_na(impl: str, D: int, segments: bool, major: int, dry: bool) -> str | None:
    """Why impl cannot run this case here (recorded as n/a), or None."""
    why = unsupported(impl, jnp.bfloat16, D)
    if why:
        return why
    if dry:
        if backend(impl).compute_capability and (D != 64 or not segments):
            return ("dry run: the Mosaic GPU interpreter (~5 s a case) runs the training case "
                    "alone: head_dim 64 with segment ids")
        return None
    return attention_refusal(impl, major)


def attention_cases(major: int, dry: bool):
    """(impl, head_dim, segments, n/a reason or None) for every attention case, in order."""
    return [(impl, D, segments, _attn_na(impl, D, segments, major, dry))
            for D in HEAD_DIMS for segments in (False, True) for impl in ATTN_IMPLS]


def _attention_rows(ctx, major: int) -> None:
    dry = ctx.dry_run
    B, S, Hq, Hkv = ATTN_SHAPE[dry]
    cases = attention_cases(major, dry)
    for D in HEAD_DIMS:
        # The same inputs as check_against_reference(seed=D) draws (the first-contact check's).
        q, k, v, do = (normal(D + i, shape, jnp.bfloat16) for i, shape in enumerate(
            [(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D)]))
        for segments in (False, True):
            seg = packed_segments(B, S) if segments else None
            ref_fn = vjp_fn(lambda q, k, v: attention_reference(
                q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                causal=True, segment_ids=seg))
            ref = None
            for impl, _, _, why in [c for c in cases if c[1:3] == (D, segments)]:
                label = {"kernel": "flash_attention", "impl": impl, "head_dim": D,
                         "segments": segments, "causal": True,
                         "shape": f"B{B} S{S} Hq{Hq}/Hkv{Hkv}"}
                if why:
                    ctx.add({**label, "status": "n/a", "reason": why})
                    continue
                if ref is None:
                    ref = jax.block_until_ready(ref_fn(q, k, v, do.astype(jnp.float32)))

                def check(impl=impl, seg=seg, ref=ref):
                    fn = vjp_fn(functools.partial(
                        flash_attention, causal=True, segment_ids=seg, impl=impl,
                        interpret=dry and impl != "cudnn"))  # config=None: the shipped one
                    return verdict(jax.block_until_ready(fn(q, k, v, do)), ref)
                # The timing sections run head_dim 128: a kernel failing or hanging there is
                # not timed (context.py); at other head dims it is only reported.
                uses = (attention_key(impl, segments),) if D == TIMED_HEAD_DIM else ()
                ctx.run_item(label, check, estimate_s=10.0, group="attention", uses=uses)
        if D == TIMED_HEAD_DIM:
            _first_contact_row(ctx, major)


def _first_contact_row(ctx, major: int) -> None:
    """What launch.train runs before a 70B run's first step on real data when measured.py holds
    no record of our kernel (titanax/train/attention_check.py): the check in a child process,
    at Llama-3-70B's head dim 128, GQA 8 and packed documents. The row is its verdict and its
    wall time (the check promises seconds, under 30 s); a mismatch fails it like any value
    row. Dry run: the grid kernel in interpret mode."""
    from titanax.train.attention_check import describe_case, run_child

    ours = our_kernel((major, 0), jnp.bfloat16, TIMED_HEAD_DIM) if not ctx.dry_run else None
    impl = ours or ("triton" if ctx.dry_run else GPU_FALLBACK)
    case = {"impl": impl, "head_dim": TIMED_HEAD_DIM, "gqa": 8, "segments": True,
            "dtype": "bfloat16"}
    label = {"kernel": "first_contact", "impl": impl, "case": describe_case(case)}

    def check():
        v = run_child(case, jax.devices()[0])
        return {**{f"{n}_rel": e for n, e in v.get("errors", {}).items()},
                "check_s": v.get("check_s"), "wall_s": v["seconds"],
                **({"error": v["error"]} if v.get("error") and "errors" not in v else {}),
                "pass": bool(v.get("pass"))}
    ctx.run_item(label, check, estimate_s=30.0, group="first_contact",
                 uses=(attention_key(impl, True),))


FP8_CASES = (("sm90", "tensorwise"), ("sm90", "rowwise"), ("sm100", "mx"),
             ("pallas_grid", "tensorwise"), ("pallas_grid", "rowwise"), ("pallas_grid", "mx"),
             ("xla", "tensorwise"), ("xla", "rowwise"), ("xla", "mx"))


def fp8_cases(cc: tuple[int, int], dry: bool):
    """(impl, mode, n/a reason or None, kwargs) for every FP8 matmul case. On a GPU what its
    generation cannot run is n/a (generation.fp8_refusal: MX on Hopper, XLA's included); the
    dry run interprets the grid kernel and the sm90 kernel."""
    out = []
    for impl, mode in FP8_CASES:
        if not dry:
            out.append((impl, mode, fp8_refusal(impl, mode, cc), {}))
        elif impl == "sm100":
            out.append((impl, mode, "jax 0.11.2's Mosaic GPU interpreter does not run "
                                    "block-scaled tcgen05", {}))
        else:
            out.append((impl, mode, None, {"interpret": plgpu.InterpretGPUParams()}
                        if impl == "sm90" else {"interpret": True}
                        if impl == "pallas_grid" else {}))
    return out


def _fp8_rows(ctx, cc: tuple[int, int]) -> None:
    for m, k, n in FP8_SHAPES[ctx.dry_run]:
        x = normal(m, (m, k), jnp.float32) * 3.0
        w = normal(n, (k, n), jnp.float32) * 0.02
        # Jitted: eager quantizers would compile every one of their ops on its own.
        tw = jax.jit(lambda x, w: (*quantize_tensorwise(x, E4M3), *quantize_tensorwise(w, E4M3)))
        rw = jax.jit(lambda x, w: (*quantize_rowwise(x, axis=1), *quantize_rowwise(w, axis=0)))
        mx = jax.jit(lambda x, w: (*quantize_mxfp8(x, axis=1), *quantize_mxfp8(w, axis=0)))
        ops = {"tensorwise": tw(x, w), "rowwise": rw(x, w), "mx": mx(x, w)}
        refs = {}
        for impl, mode, why, kw_impl in fp8_cases(cc, ctx.dry_run):
            label = {"kernel": "fp8_matmul", "impl": impl, "mode": mode,
                     "shape": f"{m}x{k}->{n}"}
            fits = {"sm90": lambda: sm90_supported(m, n, k, Sm90Config()),
                    "sm100": lambda: sm100_supported(m, n, k, Sm100Config())}.get(impl)
            if why is None and fits is not None and not fits():
                why = "shape is not whole tiles of the shipped config"
            if why:
                ctx.add({**label, "status": "n/a", "reason": why})
                continue
            if mode not in refs:
                refs[mode] = jax.block_until_ready(
                    jax.jit(fp8_matmul_reference, static_argnums=4)(*ops[mode], jnp.float32))

            def check(impl=impl, mode=mode, kw_impl=kw_impl):
                fn = jax.jit(lambda *t: fp8_matmul(*t, jnp.bfloat16, impl=impl, **kw_impl))
                got = np.asarray(jax.block_until_ready(fn(*ops[mode])), np.float32)
                ref = np.asarray(refs[mode])
                atol = FP8_TOL * float(np.max(np.abs(ref)))
                ok = bool(np.all(np.isfinite(got))
                          and np.all(np.abs(got - ref) <= atol + FP8_TOL * np.abs(ref)))
                return {**errors(got, ref), "tol": FP8_TOL, "pass": ok}
            ctx.run_item(label, check, estimate_s=5.0, group="fp8", uses=(fp8_key(impl, mode),))


def kernels_section(ctx) -> None:
    cc = compute_capability() or (0, 0)
    ctx.note(attention_tolerance=f"max|x-ref|/max|ref| < {ATTN_TOL} per tensor (bf16)",
             fp8_tolerance=f"|x-ref| <= {FP8_TOL}*|ref| + {FP8_TOL}*max|ref| (bf16 out)",
             configs="shipped: flash_attention default_config(impl, head_dim), "
                     "Sm90Config(), Sm100Config(), GridConfig()")
    _fp8_rows(ctx, cc)  # the cheap cases first: attention's compiles may use up the budget
    _attention_rows(ctx, cc[0])
