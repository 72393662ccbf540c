"""Attention as the model calls it: q [B, S, Hq, D], k/v [B, T, Hkv, D] -> [B, S, Hq, D].

`impl` picks the backend by config (model.attention_impl; the names are
pallas_kernels/flash_attention/backends.py's table): 'xla' is the reference written here
(grouped-query attention without repeating K/V in memory, softmax in float32); 'cudnn' is
jax.nn.dot_product_attention (cuDNN's fused kernel on GPU, XLA elsewhere), causal through its
CAUSAL mask type with nothing S x S built, and a dense mask only for packed documents and
decoding; 'triton', 'mosaic_sm90', 'mosaic_sm100' and 'auto' go to
pallas_kernels.flash_attention (Pallas flash kernels with their own backward, which skip the
key tiles of other documents; 'auto' chooses by the work: cuDNN for plain causal attention,
ours for packed documents and shard_map bodies, unless measured.py records ours faster; 'xla'
on a CPU). On a CPU the Pallas kernels run in interpret mode, which is slow and meant for
tests. Decoding with a KV cache (q_offset / kv_valid_len) always takes the XLA path: the flash
kernels are for training and prefill, where queries and keys are the same sequence. The flash
kernels run per device shard (parallel/per_shard.py): XLA cannot partition them. cuDNN's
attention keeps XLA's partitioning rule (inside jax.shard_map its compile crashes).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp

from pallas_kernels.flash_attention.api import (
    flash_attention,
    flash_attention_bwd,
    flash_attention_fwd,
    flash_block_bwd,
    flash_block_fwd,
)
from pallas_kernels.flash_attention.backends import BACKENDS, KERNEL_IMPLS, backend
from pallas_kernels.flash_attention.reference import block_reference_bwd, block_reference_fwd
from pallas_kernels.flash_attention.resolve import resolve_impl
from pallas_kernels.target import target_platform
from titanax.parallel.context import ContextAttention, context_shards
from titanax.parallel.per_shard import aligned, per_shard_attention, seq_axes

log = logging.getLogger(__name__)

# The names that go to pallas_kernels.flash_attention: our kernels and 'auto' (backends.py).
FLASH_IMPLS = ("auto", *KERNEL_IMPLS)

_NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(q_len: int, kv_len: int, *, causal: bool, q_offset=0,
                   q_segment_ids=None, kv_segment_ids=None, kv_valid_len=None):
    """Boolean [B or 1, 1, q_len, kv_len] mask: True where a query may attend to a key.

    q_offset shifts query positions (decoding with a KV cache: the new tokens sit at
    q_offset.. in the cache); kv_valid_len masks cache slots not yet written.
    """
    q_pos = jnp.arange(q_len)[:, None] + q_offset
    k_pos = jnp.arange(kv_len)[None, :]
    mask = jnp.ones((q_len, kv_len), dtype=bool)
    if causal:
        mask = mask & (k_pos <= q_pos)
    if kv_valid_len is not None:
        mask = mask & (k_pos < kv_valid_len)
    mask = mask[None, None]
    if q_segment_ids is not None:
        seg = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
        mask = mask & seg[:, None]
    return mask


def _attend(q_NQD, k_NTD, v_NTD, mask, B, Hkv, G, softmax_scale):
    """softmax(q k^T) v with q rows ordered (group, position): [N, G*S, D] -> [N, G*S, D]."""
    N, GS, D = q_NQD.shape
    S, T = GS // G, k_NTD.shape[1]
    scores_NQT = jnp.einsum("nqd,ntd->nqt", q_NQD, k_NTD,
                            preferred_element_type=jnp.float32) * softmax_scale
    # mask is [B|1, 1, S, T]; broadcast over kv heads and the group axis.
    scores_BKGST = jnp.where(mask[:, :, None], scores_NQT.reshape(B, Hkv, G, S, T), _NEG_INF)
    # Softmax with the normalisation deferred to the [.., D] output (a pass over [.., T]
    # fewer, forward and backward; 17% of the attention time on XLA:CPU): the row max is a
    # constant shift (no gradient), exp, then (p v) / sum(p).
    shift = jax.lax.stop_gradient(jnp.max(scores_BKGST, axis=-1, keepdims=True))
    p_BKGST = jnp.exp(scores_BKGST - shift)
    denom_NQ1 = jnp.sum(p_BKGST, axis=-1, keepdims=True).reshape(N, GS, 1)
    out_NQD = jnp.einsum("nqt,ntd->nqd", p_BKGST.astype(v_NTD.dtype).reshape(N, GS, T), v_NTD,
                         preferred_element_type=jnp.float32)
    return out_NQD / denom_NQ1


def xla_attention(q_BSHD, k_BTKD, v_BTKD, *, mask, softmax_scale, causal_chunks: int = 1):
    """causal_chunks > 1 (causal self-attention only): query chunk i attends to keys
    [0, (i+1)*S/chunks) alone, skipping the blocks the causal mask would zero anyway
    (4 chunks: 62.5% of the score work and softmax traffic)."""
    B, S, Hq, D = q_BSHD.shape
    T, Hkv = k_BTKD.shape[1], k_BTKD.shape[2]
    G = Hq // Hkv
    # Both products as one batched matmul over N = B*Hkv, the G query heads of a kv head
    # stacked along the rows: XLA:CPU runs this ~25% faster (forward + backward) than the
    # 5-D einsums, and K/V are still never repeated.
    q_NGSD = q_BSHD.reshape(B, S, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B * Hkv, G, S, D)
    k_NTD = k_BTKD.transpose(0, 2, 1, 3).reshape(B * Hkv, T, D)
    v_NTD = v_BTKD.transpose(0, 2, 1, 3).reshape(B * Hkv, T, D)
    C = S // causal_chunks
    outs = []
    for i in range(causal_chunks):
        q_NQD = q_NGSD[:, :, i * C:(i + 1) * C].reshape(B * Hkv, G * C, D)
        end = T if causal_chunks == 1 else (i + 1) * C
        out = _attend(q_NQD, k_NTD[:, :end], v_NTD[:, :end],
                      mask[:, :, i * C:(i + 1) * C, :end], B, Hkv, G, softmax_scale)
        outs.append(out.reshape(B * Hkv, G, C, D))
    out_NGSD = outs[0] if causal_chunks == 1 else jnp.concatenate(outs, axis=2)
    out_BSHD = out_NGSD.reshape(B, Hkv, G, S, D).transpose(0, 3, 1, 2, 4).reshape(B, S, Hq, D)
    return out_BSHD.astype(q_BSHD.dtype)


def attention(q_BSHD, k_BTKD, v_BTKD, *, impl: str = "xla", causal: bool = True,
              segment_ids=None, kv_segment_ids=None, q_offset=0, kv_valid_len=None,
              softmax_scale: float | None = None, context_strategy: str = "ring"):
    """context_strategy: how K/V reach the other devices when the mesh splits the sequence
    ('seq' on 'context'; parallel/context.py); the inputs are then in its balanced order."""
    S, T = q_BSHD.shape[1], k_BTKD.shape[1]
    decoding = not (isinstance(q_offset, int) and q_offset == 0) or kv_valid_len is not None
    if not decoding and kv_segment_ids is None and S == T and context_shards(S) > 1:
        return context_parallel_attention(q_BSHD, k_BTKD, v_BTKD, impl=impl, causal=causal,
                                          segment_ids=segment_ids,
                                          softmax_scale=softmax_scale,
                                          strategy=context_strategy)
    if impl in FLASH_IMPLS and not decoding and kv_segment_ids is None and S == T:
        interpret = target_platform() == "cpu" and impl != "auto"
        kw = dict(causal=causal, softmax_scale=softmax_scale, interpret=interpret)
        resolved = resolve_impl(impl, q_BSHD.dtype, q_BSHD.shape[-1], interpret=interpret,
                                segment_ids=segment_ids is not None, seq_len=S)
        if interpret:
            # Interpreted kernels are plain HLO loops that XLA partitions itself (and Pallas'
            # interpreter fails jax's varying-axes check inside shard_map).
            return flash_attention(q_BSHD, k_BTKD, v_BTKD, segment_ids=segment_ids,
                                   impl=resolved, **kw)
        if backend(resolved).is_kernel:  # XLA cannot partition a Pallas call: per shard
            fwd = functools.partial(flash_attention_fwd, impl=resolved, **kw)
            bwd = functools.partial(flash_attention_bwd, impl=resolved, **kw)
            # With segment ids the kernels' loop bounds are scalars read from their tile
            # ranges, which vary over the batch axes; jax's varying-axes check rejects such a
            # bound inside a Mosaic kernel's loops, so it is off for that call (the results
            # are typed like their inputs again, as for context parallelism).
            return per_shard_attention(fwd, bwd, q_BSHD, k_BTKD, v_BTKD, segment_ids,
                                       check_vma=segment_ids is None)
        impl = resolved  # 'auto' chose cuDNN or XLA: their own partitioning, below
    if impl in FLASH_IMPLS:
        impl = "xla"
    if q_BSHD.shape[2] % k_BTKD.shape[2]:
        raise ValueError(f"query heads {q_BSHD.shape[2]} must be a multiple of kv heads "
                         f"{k_BTKD.shape[2]}")
    scale = softmax_scale if softmax_scale is not None else q_BSHD.shape[-1] ** -0.5
    if impl == "cudnn":
        return cudnn_attention(q_BSHD, k_BTKD, v_BTKD, scale=scale, causal=causal,
                               segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                               q_offset=q_offset, kv_valid_len=kv_valid_len, decoding=decoding)
    if segment_ids is not None and kv_segment_ids is None:
        kv_segment_ids = segment_ids
    mask = attention_mask(S, T, causal=causal, q_offset=q_offset, q_segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids, kv_valid_len=kv_valid_len)
    if impl == "xla":
        # Causal self-attention skips the masked-out key blocks: up to 8 query chunks of at
        # least 64 positions (8 chunks: 56% of the full score work).
        chunks = min(8, S // 64) if causal and not decoding and S == T else 1
        chunks = chunks if chunks > 1 and S % chunks == 0 else 1
        return xla_attention(q_BSHD, k_BTKD, v_BTKD, mask=mask, softmax_scale=scale,
                             causal_chunks=chunks)
    raise ValueError(f"unknown attention impl {impl!r}; use one of {('auto', *BACKENDS)}")


@functools.cache
def _warn_dense_mask() -> None:
    log.warning("attention_impl=cudnn with packed documents (segment ids): cuDNN takes them as "
                "a dense [S, S] mask, so it computes every score (twice the causal work) and "
                "streams an S^2 bias per head; model.attention_impl=auto runs our kernels, "
                "which skip the tiles of other documents (or set data.document_masking=false)")


def cudnn_attention(q_BSHD, k_BTKD, v_BTKD, *, scale, causal, segment_ids=None,
                    kv_segment_ids=None, q_offset=0, kv_valid_len=None, decoding=False):
    """jax.nn.dot_product_attention: cuDNN's fused kernel on GPU, XLA's elsewhere. Causal
    self-attention goes as is_causal (cuDNN's CAUSAL mask type: the upper triangle is never
    computed, nothing S x S is built); packed documents and decoding need a dense mask.
    (cuDNN's packed-sequence layout, q_offsets/kv_offsets in jax's private cudnn module, needs
    a static maximum of documents per row: one too many and attention silently crosses
    documents; so packed documents go to our kernels under 'auto'.)"""
    on_gpu = target_platform() == "gpu"
    S, T = q_BSHD.shape[1], k_BTKD.shape[1]
    if not decoding:
        q_BSHD, k_BTKD, v_BTKD = aligned(q_BSHD, k_BTKD, v_BTKD)
    kw = dict(scale=scale, implementation="cudnn" if on_gpu else None)
    if not decoding and segment_ids is None and S == T:
        return jax.nn.dot_product_attention(q_BSHD, k_BTKD, v_BTKD, is_causal=causal, **kw)
    if segment_ids is not None and on_gpu:
        _warn_dense_mask()
    if segment_ids is not None and kv_segment_ids is None:
        kv_segment_ids = segment_ids
    mask = attention_mask(S, T, causal=causal, q_offset=q_offset, q_segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids, kv_valid_len=kv_valid_len)
    return jax.nn.dot_product_attention(q_BSHD, k_BTKD, v_BTKD, mask=mask, **kw)


def context_parallel_attention(q_BSHD, k_BTKD, v_BTKD, *, impl: str, causal: bool,
                               segment_ids, softmax_scale, strategy: str):
    """Causal self-attention of sequences split over the 'seq' rule's mesh axes, in
    parallel/context.py's balanced order: blocks of our kernels (or of the jnp reference for
    impl='xla') merged by their log-sum-exp, K/V exchanged by ring or all-gather."""
    if not causal:
        raise ValueError("context parallelism splits causal self-attention (its load balance "
                         "and block masks assume it); use mesh.context=1 for this call")
    if q_BSHD.shape[2] % k_BTKD.shape[2]:
        raise ValueError(f"query heads {q_BSHD.shape[2]} must be a multiple of kv heads "
                         f"{k_BTKD.shape[2]}")
    axes = seq_axes(q_BSHD.shape[1])
    C = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
    if C != context_shards(q_BSHD.shape[1]):
        raise ValueError(f"the sequence of {q_BSHD.shape[1]} splits over {axes} ({C} ways), "
                         f"which is not the context degree {context_shards(q_BSHD.shape[1])}")
    if impl == "cudnn":
        raise ValueError("cudnn attention cannot run context parallelism (it does not compile "
                         "inside jax.shard_map); use auto, xla, triton or mosaic_sm90/100")
    interpret = target_platform() == "cpu" and impl != "auto"
    resolved = impl if impl == "xla" else resolve_impl(
        impl, q_BSHD.dtype, q_BSHD.shape[-1], interpret=interpret,
        segment_ids=segment_ids is not None, manual=True)
    if resolved == "xla":
        block_fwd = functools.partial(block_reference_fwd, softmax_scale=softmax_scale)
        block_bwd = functools.partial(block_reference_bwd, softmax_scale=softmax_scale)
    else:
        kw = dict(softmax_scale=softmax_scale, impl=resolved, interpret=interpret)
        block_fwd = functools.partial(flash_block_fwd, **kw)
        block_bwd = functools.partial(flash_block_bwd, **kw)
    ctx = ContextAttention(block_fwd, block_bwd, axes, C, strategy)
    # check_vma=False: Pallas' interpreter fails the varying-axes check inside shard_map, and
    # with it on, a remat around the call (a pipeline tick) splits the blocks' constant work
    # out of the shard_map with specs on the manual 'pipeline' axis, which does not compile.
    # per_shard_attention types the results like their inputs again.
    return per_shard_attention(ctx.fwd, ctx.bwd, q_BSHD, k_BTKD, v_BTKD, segment_ids,
                               split_seq=True, check_vma=False)
