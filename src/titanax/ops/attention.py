"""Attention as the model calls it: q [B, S, Hq, D], k/v [B, T, Hkv, D] -> [B, S, Hq, D].

`impl` picks the backend by config (model.attention_impl): 'xla' is the reference written here
(grouped-query attention without repeating K/V in memory, softmax in float32); 'cudnn' is
jax.nn.dot_product_attention (cuDNN's fused kernel on GPU, XLA elsewhere); 'triton',
'mosaic_sm90' and 'auto' go to pallas_kernels.flash_attention (Pallas flash kernels with their
own backward; 'auto' picks by GPU generation, and on a CPU falls back to 'xla'). On a CPU the
Pallas kernels run in interpret mode, which is slow and meant for tests. Decoding with a KV
cache (q_offset / kv_valid_len) always takes the XLA path: the flash kernels are for training
and prefill, where queries and keys are the same sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels

FLASH_IMPLS = ("auto", "triton", "mosaic_sm90")

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


def xla_attention(q_BSHD, k_BTKD, v_BTKD, *, mask, softmax_scale):
    B, S, Hq, D = q_BSHD.shape
    Hkv = k_BTKD.shape[2]
    G = Hq // Hkv
    q_BSKGD = q_BSHD.reshape(B, S, Hkv, G, D)
    scores_BKGST = jnp.einsum("bskgd,btkd->bkgst", q_BSKGD, k_BTKD,
                              preferred_element_type=jnp.float32) * softmax_scale
    # mask is [B|1, 1, S, T]; broadcast over the group axis.
    scores_BKGST = jnp.where(mask[:, :, None], scores_BKGST, _NEG_INF)
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1).astype(v_BTKD.dtype)
    out_BSKGD = jnp.einsum("bkgst,btkd->bskgd", probs_BKGST, v_BTKD,
                           preferred_element_type=jnp.float32)
    return out_BSKGD.reshape(B, S, Hq, D).astype(q_BSHD.dtype)


def attention(q_BSHD, k_BTKD, v_BTKD, *, impl: str = "xla", causal: bool = True,
              segment_ids=None, kv_segment_ids=None, q_offset=0, kv_valid_len=None,
              softmax_scale: float | None = None):
    S, T = q_BSHD.shape[1], k_BTKD.shape[1]
    decoding = not (isinstance(q_offset, int) and q_offset == 0) or kv_valid_len is not None
    if impl in FLASH_IMPLS and not decoding and kv_segment_ids is None and S == T:
        return pallas_kernels.flash_attention(
            q_BSHD, k_BTKD, v_BTKD, causal=causal, softmax_scale=softmax_scale,
            segment_ids=segment_ids, impl=impl, interpret=jax.default_backend() == "cpu"
            and impl != "auto")
    if impl in FLASH_IMPLS:
        impl = "xla"
    if q_BSHD.shape[2] % k_BTKD.shape[2]:
        raise ValueError(f"query heads {q_BSHD.shape[2]} must be a multiple of kv heads "
                         f"{k_BTKD.shape[2]}")
    scale = softmax_scale if softmax_scale is not None else q_BSHD.shape[-1] ** -0.5
    if segment_ids is not None and kv_segment_ids is None:
        kv_segment_ids = segment_ids
    mask = attention_mask(S, T, causal=causal, q_offset=q_offset, q_segment_ids=segment_ids,
                          kv_segment_ids=kv_segment_ids, kv_valid_len=kv_valid_len)
    if impl == "xla":
        return xla_attention(q_BSHD, k_BTKD, v_BTKD, mask=mask, softmax_scale=scale)
    if impl == "cudnn":
        on_gpu = jax.default_backend() == "gpu"
        return jax.nn.dot_product_attention(
            q_BSHD, k_BTKD, v_BTKD, mask=mask, scale=scale,
            implementation="cudnn" if on_gpu else None)
    raise ValueError(f"unknown attention impl {impl!r}; use 'xla', 'cudnn' or one of "
                     f"{FLASH_IMPLS}")
