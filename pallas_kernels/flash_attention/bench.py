"""Forward and backward TFLOP/s of flash attention backends at Llama-3-70B attention shapes
(64 q heads, 8 kv heads, head_dim 128, causal, bf16). `python -m launch.bench attention` and
titanax's gpu_check time through these functions, so both report the same numbers.

FLOPs are counted as the FlashAttention papers count them: forward = 4 * B * S^2 * Hq * D
(QK^T and PV, 2 FLOPs per multiply-add), halved when causal; backward = 2.5 x forward (five
matmuls instead of two; the recomputation of QK^T is not counted as useful work). With packed
documents (doc_tokens > 0: documents of that many tokens, the last one cut by the window) the
count is the visible pairs only: 4 * Hq * D * sum over documents of L(L+1)/2 per sequence, the
work a kernel that skips other documents' tiles can at best do. The backward time is
(forward+backward) - forward, each the median of `iters` timed calls after warm-up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..target import compute_capability
from ..timing import median_call_seconds
from .api import flash_attention
from .backends import BACKENDS, GPU_FALLBACK, generation_kernels
from .resolve import unsupported

HQ, HKV, D = 64, 8, 128
FLOPS = ("fwd = 4*B*S^2*Hq*D (/2 causal; packed documents: 4*B*Hq*D*sum L(L+1)/2 over "
         "documents); bwd = 2.5*fwd")


def attention_flops(B, S, Hq, D, *, causal, doc_tokens: int = 0):
    if doc_tokens and causal:
        lengths = [min(doc_tokens, S - start) for start in range(0, S, doc_tokens)]
        fwd = 4 * B * Hq * D * sum(n * (n + 1) // 2 for n in lengths)
    else:
        fwd = 4 * B * S * S * Hq * D // (2 if causal else 1)
    return fwd, 2.5 * fwd


def packed_segment_ids(B: int, S: int, doc_tokens: int):
    """[B, S] int32 ids of documents of doc_tokens tokens packed back to back (0: one
    document per sequence), as the data pipeline's packing numbers them (monotone)."""
    ids = jnp.arange(S, dtype=jnp.int32) // (doc_tokens or S)
    return jnp.broadcast_to(ids, (B, S))


def default_impls() -> list[str]:
    """Every backend that runs here as a kernel: this GPU generation's, the portable grid
    kernel and the non-kernel backends; off a GPU the non-kernel ones alone (interpret-mode
    kernels measure the interpreter, not a kernel)."""
    others = [n for n, b in BACKENDS.items() if not b.is_kernel]
    if jax.default_backend() != "gpu":
        return others
    major = (compute_capability() or (0, 0))[0]
    return [b.name for b in generation_kernels(major)] + [GPU_FALLBACK] + others


def bench_one(impl, B, S, *, causal, iters, segments: bool = False, doc_tokens: int = 0,
              attend=None) -> dict:
    """One row. segments: packed-document segment ids through the kernels' segment path, of
    documents of doc_tokens tokens (0: one document per sequence, so the FLOP count is
    unchanged). attend(q, k, v, segment_ids) replaces flash_attention(impl=impl) (e.g. the
    model's own attention call); impl then only labels the row."""
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (B, S, HQ, D), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, S, HKV, D), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, S, HKV, D), jnp.bfloat16)
    seg = packed_segment_ids(B, S, doc_tokens) if segments else None
    attn = attend or (lambda q, k, v, s: flash_attention(q, k, v, causal=causal, segment_ids=s,
                                                         impl=impl))
    fwd = jax.jit(attn)
    fwd_bwd = jax.jit(jax.grad(lambda q, k, v, s: attn(q, k, v, s).astype(jnp.float32).sum(),
                               argnums=(0, 1, 2)))
    t_fwd = median_call_seconds(fwd, (q, k, v, seg), iters)
    t_all = median_call_seconds(fwd_bwd, (q, k, v, seg), iters)
    f_fwd, f_bwd = attention_flops(B, S, HQ, D, causal=causal,
                                   doc_tokens=doc_tokens if segments else 0)
    t_bwd = max(t_all - t_fwd, 1e-9)
    return {"impl": impl, "batch": B, "seq": S, "causal": causal, "segments": segments,
            **({"doc_tokens": doc_tokens} if segments and doc_tokens else {}),
            "fwd_ms": t_fwd * 1e3,
            "bwd_ms": t_bwd * 1e3, "fwd_tflops": f_fwd / t_fwd / 1e12,
            "bwd_tflops": f_bwd / t_bwd / 1e12, "fwd_bwd_tflops": (f_fwd + f_bwd) / t_all / 1e12}


def bench_row(impl, B, S, *, causal, iters) -> dict:
    """bench_one, or a row with the error: one backend failing (OOM, unsupported inputs) must
    not stop the others."""
    try:
        why = unsupported(impl, jnp.bfloat16, D)
        if why:
            raise ValueError(why)
        return bench_one(impl, B, S, causal=causal, iters=iters)
    except Exception as e:  # noqa: BLE001 - reported in the row
        return {"impl": impl, "batch": B, "seq": S, "causal": causal,
                "error": f"{type(e).__name__}: {str(e)[:300]}"}


def header(causal: bool) -> dict:
    """What the rows were measured on, for the JSON next to them."""
    return {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__, "q_heads": HQ, "kv_heads": HKV, "head_dim": D,
            "dtype": "bfloat16", "causal": causal, "flops": FLOPS}
