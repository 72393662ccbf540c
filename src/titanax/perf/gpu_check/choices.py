"""Section 'choices': each kernel choice made without a GPU, timed against its alternative in the
same loan. The variant running now (`shipped`) runs first; `vs_shipped` = its time / the
variant's (above 1: the alternative is faster).

Speed-only attention knobs carry `tunes` (a measured.TUNED name) and their FlashConfig `knobs`:
`launch.gpu_check --apply` makes a variant faster by apply.MARGIN this GPU generation's default
(pallas_kernels/measured.py TUNED, read by flash_attention.default_config). The rest are
reported only: FP8 promotion trades accuracy, and the documents row compares with cuDNN.
They run in CHOICES' order, the most valuable first, since the section's budget cuts the
tail: the fused backwards, the tcgen05 forms, the FP8 structure, the documents row, then the
sm90 forward's FA3 forms (measured on the 2026-12-04 H200), the rest.

- fp8_promotion (Hopper): the sm90 FP8 GEMM promoting its accumulator to float32 every K tile
  (Sm90Config.promote_every=1, shipped: accuracy) against never (0);
- fp8_tile (Hopper): its 64 x 128 tile (shipped) against 128 x 128 (without promotion: with it,
  128 x 128 spills);
- fp8_structure (Hopper): that kernel (shipped) against Sm90Config(structure="ws_2wg"), the
  warp-specialized persistent variant, at 128 x 128 with promotion and 128 x 256 without
  (docs/fp8.md);
- triton_warps_hd64: the portable attention kernel at head_dim 64 with 8 warps (shipped: 4
  spill on sm_100) against 4;
- triton_stages_bwd_hd256: its backward at head_dim 256 unpipelined (num_stages_bwd=1,
  shipped: 2 stages spill) against 2 stages;
- sm90_bwd_fused, sm90_bwd_fused_hd64 (Hopper, head_dim 128 and 64): the backward as FA3's
  one kernel (FlashConfig.bwd_fused, shipped on at both by the SASS audit's static bound:
  synchronous at 128, asynchronous at 64, docs/attention.md) against the dq and dkv kernels
  (off); a win of the split form turns it off through TUNED for that head_dim bucket;
- sm90_fwd_overlap, sm90_fwd_persistent (Hopper, head_dim 128): FlashConfig's FA3 forms of
  the forward, each off (shipped) against on; their wins and sm90_bwd_fused's merge into one
  TUNED entry;
- sm100_bwd_fused (Blackwell, head_dim 128): the tcgen05 backward as one kernel (FlashConfig.
  bwd_fused: dkv's kernel also computing dQ_t = dS_t K per tile, added by TMA reduce-add)
  against the dq and dkv kernels (shipped);
- sm100_fwd_q_tiles (Blackwell, head_dim 128): the tcgen05 forward with two 128-row query
  tiles per CTA, a softmax warpgroup each (FlashConfig.fwd_q_tiles=2, FA4's q_stage=2; 64-key
  tiles so that both tiles' scores and O fit TMEM) against one (shipped);
- sm100_fwd_exp2_fma (Blackwell, head_dim 128): the tcgen05 forward computing one of each key
  tile's 32-score slices' exp2 by a polynomial on the FMA units (FlashConfig.fwd_exp2_fma,
  FA4's emulation) against all on MUFU (shipped);
- sm100_tmem_buffers_bwd (Blackwell): the tcgen05 backward at head_dim 128 with its X/Y score
  tiles double-buffered in TMEM (shipped: the next tile's MMAs overlap this one's softmax)
  against one buffer (each tile waits for the last);
- documents: packed 2,048-token documents in 8,192-token windows on our kernel for this GPU
  (what `auto` picks) against cuDNN with the documents as a dense mask.

Every attention variant other than the shipped one is also checked against it: output and
gradients on the same inputs within AGREE_TOL (twice kernels.ATTN_TOL, the shipped one being
checked against the reference in the kernels section). The opt-in forms have never run on a
GPU before their loan, so one that disagrees fails its row and --apply cannot adopt it.

Attention cases: 64 q / 8 kv heads, causal, bf16, 16,384 tokens per call, forward and backward
(FLOPs as the attention section counts them); FP8 GEMMs at M = 8192, K = 8192, N = 28672,
FLOPs 2*M*N*K. Each time is the median of the timed calls after warm-up. Dry run: tiny shapes
in the interpreters, one timed call (exercises the code; the times mean nothing).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash_attention import default_config, flash_attention
from pallas_kernels.flash_attention.bench import attention_flops, packed_segment_ids
from pallas_kernels.flash_attention.config import base_config, tuned_key
from pallas_kernels.fp8 import fp8_matmul, quantize_tensorwise
from pallas_kernels.fp8.config import E4M3, Sm90Config
from pallas_kernels.target import compute_capability
from pallas_kernels.timing import median_call_seconds
from titanax.perf.gpu_check.context import attention_key, fp8_key
from titanax.perf.gpu_check.device import our_attention_impl
from titanax.perf.gpu_check.kernels import ATTN_TOL, errors


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    shipped: bool  # tunable choices: decided at run time (the config default_config gives now)
    run: dict  # measure()'s keywords
    knobs: dict = dataclasses.field(default_factory=dict)  # FlashConfig fields over the base


@dataclasses.dataclass(frozen=True)
class Choice:
    name: str
    question: str
    generation: int | None  # compute capability major it applies to; None: every GPU
    variants: tuple
    tunes: tuple | None = None  # (impl, head_dim) whose default a faster variant replaces


def _knob(impl: str, head_dim: int, label: str, **knobs) -> Variant:
    """A variant of the attention kernel `impl` at `head_dim`: its config is the one running
    now (default_config, measured tuning included) with `knobs` set (variant_config)."""
    return Variant(label, False, {"kind": "attention", "impl": impl, "head_dim": head_dim},
                   knobs)


def variant_config(choice: Choice, var: Variant):
    """A tunable variant's FlashConfig on this GPU now: default_config with its knobs, so that
    after an --apply made one knob a default the other choices of that config still have a
    variant equal to what runs (their shipped row) and keep that knob."""
    return dataclasses.replace(default_config(*choice.tunes), **var.knobs)


def is_base(choice: Choice, var: Variant) -> bool:
    """Whether the variant's knobs are the shipped table's own values (winning, it drops
    them from TUNED instead of setting them)."""
    base = base_config(*choice.tunes)
    return all(getattr(base, k) == v for k, v in var.knobs.items())


def _toggle(name: str, question: str, generation: int, impl: str, knob: str,
            head_dim: int = 128) -> Choice:
    """A boolean FlashConfig knob of `impl` at head_dim, off against on: whichever of the two
    default_config gives now is the shipped row (ordered_variants), and the other, winning,
    sets its value in TUNED (or, being the shipped table's, removes the knob from it)."""
    return Choice(name, question, generation, (
        _knob(impl, head_dim, f"{knob}=False", **{knob: False}),
        _knob(impl, head_dim, f"{knob}=True", **{knob: True})), tunes=(impl, head_dim))


CHOICES = (
    # Run in this order, the most valuable first: the section's budget (sections.py) cuts
    # the tail of a loan's list. The attention kernels' forms of each GPU generation (the
    # other's are n/a at no cost), then the FP8 structure and the documents row, then the rest.
    # The fused backward first: shipped on by the static bound alone, these rows are what a
    # GPU says of it (at 64 its asynchronous form, at 128 the synchronous one).
    _toggle("sm90_bwd_fused", "Hopper attention backward at head_dim 128: FA3's one kernel (dQ "
            "by TMA reduce-add; synchronous at 128) or the dq and dkv kernels", 9,
            "mosaic_sm90", "bwd_fused"),
    _toggle("sm90_bwd_fused_hd64", "Hopper attention backward at head_dim 64: FA3's one kernel, "
            "asynchronous (exp2 and dS under the MMAs, dQ by TMA reduce-add), or the dq and "
            "dkv kernels", 9, "mosaic_sm90", "bwd_fused", head_dim=64),
    _toggle("sm100_bwd_fused", "tcgen05 attention backward at head_dim 128: one kernel (dQ_t = "
            "dS_t K per tile, TMA reduce-add; X/Y in one TMEM buffer) or the dq and dkv "
            "kernels", 10, "mosaic_sm100", "bwd_fused"),
    Choice("sm100_fwd_q_tiles", "tcgen05 attention forward at head_dim 128: one 128-row query "
           "tile per CTA, or FA4's two (a softmax warpgroup each, 64-key tiles for TMEM)", 10, (
               _knob("mosaic_sm100", 128, "fwd_q_tiles=1, block_kv=128", fwd_q_tiles=1,
                     block_kv=128),
               _knob("mosaic_sm100", 128, "fwd_q_tiles=2, block_kv=64", fwd_q_tiles=2,
                     block_kv=64)),
           tunes=("mosaic_sm100", 128)),
    _toggle("sm100_fwd_exp2_fma", "tcgen05 attention forward at head_dim 128: every exp2 on "
            "MUFU, or a quarter of them as a polynomial on the FMA units (FA4)", 10,
            "mosaic_sm100", "fwd_exp2_fma"),
    Choice("sm100_tmem_buffers_bwd", "tcgen05 attention backward at head_dim 128: X/Y scores "
           "double-buffered in TMEM, or one buffer", 10, (
               _knob("mosaic_sm100", 128, "tmem_buffers_bwd=None (2 at head_dim 128)",
                     tmem_buffers_bwd=None),
               _knob("mosaic_sm100", 128, "tmem_buffers_bwd=1", tmem_buffers_bwd=1)),
           tunes=("mosaic_sm100", 128)),
    # (128 x 192, ws_2wg's widest promoted tile, does not divide N = 28672.)
    Choice("fp8_structure", "sm90 FP8 GEMM: one warpgroup per 64 x 128 tile, or warp-"
           "specialized (TMA producer + 2 wgmma consumers), persistent, 128 x N", 9, (
               Variant("single_wg 64x128", True, {"kind": "fp8", "config": Sm90Config()}),
               Variant("ws_2wg 128x128", False, {"kind": "fp8", "config": Sm90Config(
                   structure="ws_2wg", tile_m=128, tile_n=128)}),
               Variant("ws_2wg 128x256, promote_every=0, 3 stages, epilogue_n=64", False,
                       {"kind": "fp8", "config": Sm90Config(
                           structure="ws_2wg", tile_m=128, tile_n=256, max_concurrent_steps=3,
                           promote_every=0, epilogue_n=64)}))),
    Choice("documents", "2k-token documents in 8k windows: our tile-skipping kernel or cuDNN "
           "with a dense mask", None, (
               Variant("ours (auto)", True, {"kind": "attention", "impl": "ours",
                                             "documents": True}),
               Variant("cudnn, dense mask", False, {"kind": "attention", "impl": "cudnn",
                                                    "documents": True}))),
    # The sm90 forward's FA3 forms after the documents row: the 2026-12-04 H200 measured them
    # (0.997x, 1.005x, 0.975x), and the budget is what the fused rows above cost.
    _toggle("sm90_fwd_overlap", "Hopper attention forward at head_dim 128: FA3's intra-"
            "warpgroup overlap (next QK^T issued before this tile's softmax) or not", 9,
            "mosaic_sm90", "fwd_overlap"),
    Choice("sm90_fwd_persistent", "Hopper attention forward at head_dim 128: one CTA per "
           "output tile, or persistent (one per SM walking the tiles, longest first, the next "
           "tile's K/V loaded under this tile's epilogue), alone and with fwd_overlap (FA3's "
           "form)", 9, (
               _knob("mosaic_sm90", 128, "fwd_persistent=False", fwd_persistent=False),
               _knob("mosaic_sm90", 128, "fwd_persistent=True", fwd_persistent=True),
               _knob("mosaic_sm90", 128, "fwd_persistent=True, fwd_overlap=True",
                     fwd_persistent=True, fwd_overlap=True)),
           tunes=("mosaic_sm90", 128)),
    Choice("fp8_promotion", "sm90 FP8 GEMM: float32 promotion every K tile, or never", 9, (
        Variant("promote_every=1", True, {"kind": "fp8", "config": Sm90Config()}),
        Variant("promote_every=0", False, {"kind": "fp8",
                                           "config": Sm90Config(promote_every=0)}))),
    Choice("fp8_tile", "sm90 FP8 GEMM tile: 64 x 128 or 128 x 128", 9, (
        Variant("64x128", True, {"kind": "fp8", "config": Sm90Config()}),
        Variant("128x128, promote_every=0", False, {"kind": "fp8", "config": Sm90Config(
            tile_m=128, tile_n=128, promote_every=0)}))),
    Choice("triton_warps_hd64", "portable attention kernel at head_dim 64: 8 or 4 warps", None, (
        _knob("triton", 64, "num_warps=8", num_warps=8),
        _knob("triton", 64, "num_warps=4", num_warps=4)), tunes=("triton", 64)),
    Choice("triton_stages_bwd_hd256", "portable attention backward at head_dim 256: 1 or 2 "
           "pipeline stages", None, (
               _knob("triton", 256, "num_stages_bwd=1", num_stages_bwd=1),
               _knob("triton", 256, "num_stages_bwd=2", num_stages_bwd=2)),
           tunes=("triton", 256)),
)


def ordered_variants(choice: Choice) -> list[tuple[Variant, bool]]:
    """(variant, shipped) with the shipped one first. A tunable choice's shipped variant is the
    one whose config default_config gives on this GPU now (measured tuning included)."""
    if choice.tunes is None:
        marked = [(v, v.shipped) for v in choice.variants]
    else:
        now = default_config(*choice.tunes)
        marked = [(v, variant_config(choice, v) == now) for v in choice.variants]
    return sorted(marked, key=lambda vs: not vs[1])


# (tokens per call, seq, q heads, kv heads, doc tokens, timed calls); FP8 (M, K, N).
GPU_ATTENTION = (16384, 8192, 64, 8, 2048, 10)
DRY_ATTENTION = (128, 128, 2, 1, 32, 1)
GPU_GEMM, DRY_GEMM = (8192, 8192, 28672), (128, 256, 256)


# An attention variant's output and gradients against the shipped variant's on the same inputs:
# each is within kernels.ATTN_TOL of the exact answer (the kernels section checks the shipped
# one against the reference), so two correct kernels differ by less than twice that.
AGREE_TOL = 2 * ATTN_TOL


def _agreement(got, held: dict, shipped: bool) -> dict:
    """The shipped variant's arrays are kept in `held`; any other variant's are compared with
    them: a wrong kernel (never run on a GPU before its loan) fails its row, so --apply cannot
    adopt it however fast it is. No shipped arrays (its row failed): nothing to adopt."""
    if shipped:
        held["arrays"] = got
        return {}
    if "arrays" not in held:
        return {}
    rel = {name: errors(x, r)["rel"]
           for name, x, r in zip(("out", "dq", "dk", "dv"), got, held["arrays"])}
    return {"vs_shipped_rel": rel, "tol": AGREE_TOL,
            "pass": all(e < AGREE_TOL for e in rel.values())}


def _attention(ctx, impl, head_dim=128, config=None, documents=False, held=None,
               shipped=False, **_) -> dict:
    tokens, S, hq, hkv, doc, iters = DRY_ATTENTION if ctx.dry_run else GPU_ATTENTION
    B = max(1, tokens // S)
    if ctx.dry_run and impl != "triton":
        impl = "xla"  # the interpreters cannot stand in for cuDNN or a Mosaic kernel's speed
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, S, h, head_dim), np.float32), jnp.bfloat16)
               for h in (hq, hkv, hkv))
    seg = packed_segment_ids(B, S, doc) if documents else None
    kw = {"interpret": True} if ctx.dry_run and impl == "triton" else {}

    def fwd_bwd(q, k, v, s):  # the output and its gradients for d(sum of the output)
        out, vjp = jax.vjp(lambda q, k, v: flash_attention(
            q, k, v, causal=True, segment_ids=s, impl=impl, config=config, **kw), q, k, v)
        return (out, *vjp(jnp.ones_like(out)))
    fn = jax.jit(fwd_bwd)
    sec = median_call_seconds(fn, (q, k, v, seg), iters)
    f_fwd, f_bwd = attention_flops(B, S, hq, head_dim, causal=True,
                                   doc_tokens=doc if documents else 0)
    checked = _agreement(fn(q, k, v, seg), held, shipped) if held is not None else {}
    return {"ms": sec * 1e3, "tflops": (f_fwd + f_bwd) / sec / 1e12, "impl": impl,
            "shape": f"B{B} S{S} Hq{hq}/Hkv{hkv} D{head_dim}", **checked}


def _gemm(ctx, config, **_) -> dict:
    m, k, n = DRY_GEMM if ctx.dry_run else GPU_GEMM
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32))
    w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02)
    ops = jax.jit(lambda x, w: (*quantize_tensorwise(x, E4M3), *quantize_tensorwise(w, E4M3)))(
        x, w)
    if ctx.dry_run:
        from jax.experimental.pallas import mosaic_gpu as plgpu
        kw = {"interpret": plgpu.InterpretGPUParams()}
    else:
        kw = {}
    fn = jax.jit(lambda *t: fp8_matmul(*t, jnp.bfloat16, impl="sm90", config=config, **kw))
    sec = median_call_seconds(fn, ops, 1 if ctx.dry_run else 20)
    return {"ms": sec * 1e3, "tflops": 2.0 * m * n * k / sec / 1e12,
            "shape": f"{m}x{k}->{n}"}


def _uses(run: dict, ours: str) -> tuple:
    if run["kind"] == "fp8":
        return (fp8_key("sm90", "tensorwise"),)
    impl = ours if run["impl"] == "ours" else run["impl"]
    return (attention_key(impl, run.get("documents", False)),)


def choices_section(ctx) -> None:
    cc = None if ctx.dry_run else compute_capability()
    ours = "xla" if ctx.dry_run else our_attention_impl()
    ctx.note(ours=ours, vs_shipped="shipped variant's time / this variant's (> 1: faster)",
             flops="attention fwd+bwd = 3.5 x 4*B*S^2*Hq*D/2 (documents: visible pairs); "
                   "GEMM 2*M*N*K")
    for choice in CHOICES:
        shipped_ms, held = None, {}
        for var, shipped in ordered_variants(choice):
            label = {"choice": choice.name, "variant": var.label, "shipped": shipped}
            if choice.tunes is not None:
                label.update(tunes=tuned_key(*choice.tunes), knobs=dict(var.knobs),
                             base=is_base(choice, var))
            if cc is not None and choice.generation not in (None, cc[0]):
                ctx.add({**label, "status": "n/a", "reason": f"a compute capability "
                         f"{choice.generation}.x choice; this GPU is {cc[0]}.{cc[1]}"})
                continue
            run = dict(var.run)
            if choice.tunes is not None:
                run["config"] = variant_config(choice, var)
            if run.get("impl") == "ours":
                run["impl"] = ours
            if run.pop("kind") == "fp8":
                measure = _gemm
            else:
                measure = functools.partial(_attention, held=held, shipped=shipped)
            row = ctx.run_item(label, lambda m=measure, r=run: m(ctx, **r), estimate_s=20.0,
                               group="choices", uses=_uses(var.run, ours))
            if row.get("status") != "ok":
                continue
            if shipped:
                shipped_ms = row["ms"]
            elif shipped_ms:
                row["vs_shipped"] = shipped_ms / row["ms"]
                ctx.flush()
