"""flash_attention: one entry point, dispatched through the backend table (backends.py).

    flash_attention(q, k, v, *, causal=True, softmax_scale=None, segment_ids=None,
                    kv_segment_ids=None, q_offset=0, kv_valid_len=None, impl="auto",
                    config=None, interpret=False)

q [B, S, H, K]; k, v [B, T, N, K] with H a multiple of N (GQA: K/V are never repeated in
memory); segment_ids [B, S] int (with S == T, or with kv_segment_ids [B, T]) keep attention
inside packed documents; q_offset / kv_valid_len place the queries in a KV cache (decoding).
Any S and T. The call goes to the table entry's one function (Backend.run) with a mask.Mask;
a backend that cannot take the mask (our kernels: decoding) hands it to backends.GENERAL.
flash_attention_fwd / flash_attention_bwd are the two halves of a Pallas kernel pair, for
callers that run them separately (under jax.shard_map, as titanax.parallel.per_shard does);
flash_block_fwd / flash_block_bwd one block of context parallelism's blockwise attention.

impl: a name in backends.py's table or "auto" (resolve.py: on GPU cuDNN unless measured.py
records ours faster there, or segment ids / a shard_map body rule cuDNN out; the choice and
its reason are logged once).
"""

from __future__ import annotations

import jax.numpy as jnp

from . import pair
from .backends import GENERAL, IMPLS, KERNEL_IMPLS, Backend, backend, load
from .config import FlashConfig, default_config
from .mask import Mask
from .resolve import resolve_impl, unsupported

__all__ = ["IMPLS", "attention_backend", "flash_attention", "flash_attention_bwd",
           "flash_attention_fwd", "flash_block_bwd", "flash_block_fwd", "resolve_impl"]

def attention_backend(impl: str, dtype, head_dim: int, mask: Mask | None = None, *,
                      interpret: bool = False, manual: bool | None = None,
                      seq_len: int | None = None) -> Backend:
    """The table entry that runs a call: `impl` resolved (resolve.py), then handed to
    backends.GENERAL when it cannot take the mask."""
    mask = Mask() if mask is None else mask
    name = resolve_impl(impl, dtype, head_dim, interpret=interpret,
                        segment_ids=mask.segment_ids is not None, manual=manual,
                        seq_len=seq_len, general=mask.general)
    b = backend(name)
    return b if b.general_masks or not mask.general else backend(GENERAL)


def flash_attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None,
                    segment_ids=None, kv_segment_ids=None, q_offset=0, kv_valid_len=None,
                    impl: str = "auto", config: FlashConfig | None = None,
                    interpret: bool = False):
    mask = _mask(q, k, Mask(causal, segment_ids, kv_segment_ids, q_offset, kv_valid_len))
    b, scale, cfg = _prepare(q, k, v, mask, softmax_scale, impl, config, interpret)
    return load(b.run)(q, k, v, mask, softmax_scale=scale, impl=b.name, config=cfg,
                       interpret=interpret)


def flash_attention_fwd(q, k, v, segment_ids=None, *, causal: bool = True,
                        softmax_scale: float | None = None, impl: str = "auto",
                        config: FlashConfig | None = None, interpret: bool = False):
    """The forward of a Pallas impl alone: (out, lse), lse [B, H, S padded] being what
    flash_attention_bwd needs (in the kernel's own units). With the same arguments the pair is
    flash_attention and its VJP, for callers that place the two halves themselves (jax.shard_map
    in titanax.parallel.per_shard)."""
    mask = _mask(q, k, Mask(causal, segment_ids))
    b, scale, cfg = _prepare(q, k, v, mask, softmax_scale, impl, config, interpret,
                             pallas_only=True)
    return pair.forward(q, k, v, mask.segment_ids, causal=causal, softmax_scale=scale,
                        impl=b.name, config=cfg, interpret=interpret)


def flash_attention_bwd(q, k, v, segment_ids, out, lse, do, *, causal: bool = True,
                        softmax_scale: float | None = None, impl: str = "auto",
                        config: FlashConfig | None = None, interpret: bool = False):
    """(dq, dk, dv) for flash_attention_fwd's (out, lse) and the output cotangent do."""
    mask = _mask(q, k, Mask(causal, segment_ids))
    b, scale, cfg = _prepare(q, k, v, mask, softmax_scale, impl, config, interpret,
                             pallas_only=True)
    return pair.backward(q, k, v, mask.segment_ids, out, lse, do, causal=causal,
                         softmax_scale=scale, impl=b.name, config=cfg, interpret=interpret)


def flash_block_fwd(q, k, v, q_segment_ids=None, kv_segment_ids=None, *, causal: bool,
                    softmax_scale: float | None = None, impl: str = "auto",
                    config: FlashConfig | None = None, interpret: bool = False):
    """One block of a blockwise (ring) attention: queries against a block of keys that may be
    another part of the sequence (any S, T; causal needs S == T, the same positions).
    (out [B, S, H, K], lse [B, H, S] float32 in natural-log units, unpadded): blocks merge
    by their log-sum-exp whatever the backend's own units."""
    b, q_seg, kv_seg, kw = _prepare_block(q, k, v, q_segment_ids, kv_segment_ids, causal,
                                          softmax_scale, impl, config, interpret)
    return load(b.block_fwd)(q, k, v, q_seg, kv_seg, **kw)


def flash_block_bwd(q, k, v, q_segment_ids, kv_segment_ids, out, lse, do, *, causal: bool,
                    softmax_scale: float | None = None, impl: str = "auto",
                    config: FlashConfig | None = None, interpret: bool = False):
    """(dq, dk, dv) of one block given the whole row's out and natural-log lse [B, H, S]
    (the merge of every block): FlashAttention-2's backward recomputes this block's
    probabilities from the final lse, so the blocks' gradients sum to the exact gradient."""
    b, q_seg, kv_seg, kw = _prepare_block(q, k, v, q_segment_ids, kv_segment_ids, causal,
                                          softmax_scale, impl, config, interpret)
    return load(b.block_bwd)(q, k, v, q_seg, kv_seg, out, lse, do, **kw)


def _prepare_block(q, k, v, q_seg, kv_seg, causal, softmax_scale, impl, config, interpret):
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"a causal block needs queries and keys at the same positions; got "
                         f"S={q.shape[1]}, T={k.shape[1]}")
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("pass segment ids for both queries and keys, or for neither")
    mask = _mask(q, k, Mask(causal, q_seg, kv_seg))
    b, scale, cfg = _prepare(q, k, v, Mask(causal, mask.segment_ids), softmax_scale, impl,
                             config, interpret, manual=True)
    if b.block_fwd is None:
        raise ValueError(f"{b.name} attention cannot be a block of context parallelism (it "
                         "does not compile inside jax.shard_map)")
    kw = dict(causal=causal, softmax_scale=scale, impl=b.name, config=cfg, interpret=interpret)
    return b, mask.segment_ids, mask.kv_segment_ids, kw


def _mask(q, k, mask: Mask) -> Mask:
    """The mask with its segment ids checked against q and k and made int32."""
    (B, S), T = q.shape[:2], k.shape[1]
    seg, kv_seg = mask.segment_ids, mask.kv_segment_ids
    if seg is None:
        if kv_seg is not None:
            raise ValueError("kv_segment_ids need segment_ids for the queries")
        return mask
    if kv_seg is None and (S != T or seg.shape != (B, S)):
        raise ValueError(f"segment_ids must be [B, S] = {(B, S)} with S == T; got "
                         f"{seg.shape}, T={T}")
    if kv_seg is not None and (seg.shape != (B, S) or kv_seg.shape != (B, T)):
        raise ValueError(f"segment ids {seg.shape}, {kv_seg.shape} must be [B, S] {(B, S)} "
                         f"and [B, T] {(B, T)}")
    as_int = lambda s: None if s is None else s.astype(jnp.int32)
    return Mask(mask.causal, as_int(seg), as_int(kv_seg), mask.q_offset, mask.kv_valid_len)


def _prepare(q, k, v, mask, softmax_scale, impl, config, interpret, pallas_only=False,
             manual=None):
    """Checks the inputs; (the backend that runs them, scale, its kernel config or None)."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"expected q [B,S,H,K], k=v [B,T,N,K]; got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    B, S, H, K = q.shape
    if k.shape[0] != B or k.shape[3] != K:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape} in batch or head_dim")
    if H % k.shape[2]:
        raise ValueError(f"q heads {H} must be a multiple of kv heads {k.shape[2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    scale = float(K ** -0.5 if softmax_scale is None else softmax_scale)
    b = attention_backend(impl, q.dtype, K, mask, interpret=interpret, manual=manual)
    if not b.is_kernel:
        if pallas_only:
            raise ValueError(f"flash_attention_fwd/bwd run the Pallas impls {KERNEL_IMPLS}; "
                             f"impl resolved to {b.name!r}: call flash_attention instead")
        return b, scale, None
    why = unsupported(b.name, q.dtype, K)
    if why:
        raise ValueError(why)
    cfg = config if config is not None else default_config(b.name, K, interpret=interpret)
    if b.mosaic:
        cfg.check_mosaic()
    return b, scale, cfg
