"""Pure-jnp flash attention reference: the semantics every kernel is tested against.

q [B, S, Hq, D], k/v [B, T, Hkv, D] (Hq a multiple of Hkv, grouped without repeating K/V);
causal means key t is visible to query s when t <= s; segment_ids [B, S] (S == T) keep
attention inside a packed document. Masked scores get a large finite negative value (not
-inf), so a fully masked row stays finite, exactly as the kernels do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def mask_SxT(S: int, T: int, *, causal: bool, segment_ids=None):
    """Boolean [B|1, S, T]: True where query s may attend key t."""
    mask = jnp.ones((1, S, T), bool)
    if causal:
        mask &= (jnp.arange(T)[None, :] <= jnp.arange(S)[:, None])[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return mask


def attention_reference(q_BSHD, k_BTKD, v_BTKD, *, causal=True, softmax_scale=None,
                        segment_ids=None, return_lse=False):
    B, S, Hq, D = q_BSHD.shape
    T, Hkv = k_BTKD.shape[1], k_BTKD.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    q_BSKGD = q_BSHD.reshape(B, S, Hkv, G, D)
    prec = jax.lax.Precision.HIGHEST
    s_BKGST = jnp.einsum("bskgd,btkd->bkgst", q_BSKGD, k_BTKD, precision=prec,
                         preferred_element_type=jnp.float32) * scale
    mask = mask_SxT(S, T, causal=causal, segment_ids=segment_ids)
    s_BKGST = jnp.where(mask[:, None, None], s_BKGST, MASK_VALUE)
    lse_BKGS = jax.nn.logsumexp(s_BKGST, axis=-1)
    p_BKGST = jnp.exp(s_BKGST - lse_BKGS[..., None]).astype(v_BTKD.dtype)
    o_BSKGD = jnp.einsum("bkgst,btkd->bskgd", p_BKGST, v_BTKD, precision=prec,
                         preferred_element_type=jnp.float32)
    out = o_BSKGD.reshape(B, S, Hq, D).astype(q_BSHD.dtype)
    if return_lse:
        return out, lse_BKGS.reshape(B, Hq, S)
    return out


def _block_scores(q_BSHD, k_BTKD, q_seg, kv_seg, causal, scale):
    """Masked scaled scores [B, Hkv, G, S, T] float32 of a block (keys at other positions
    than the queries unless causal)."""
    B, S, Hq, D = q_BSHD.shape
    T, Hkv = k_BTKD.shape[1], k_BTKD.shape[2]
    q_BSKGD = q_BSHD.reshape(B, S, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bskgd,btkd->bkgst", q_BSKGD, k_BTKD,
                   preferred_element_type=jnp.float32) * scale
    mask = jnp.ones((1, S, T), bool)
    if causal:
        mask &= (jnp.arange(T)[None, :] <= jnp.arange(S)[:, None])[None]
    if q_seg is not None:
        mask = mask & (q_seg[:, :, None] == kv_seg[:, None, :])
    return jnp.where(mask[:, None, None], s, MASK_VALUE)


def block_reference_fwd(q_BSHD, k_BTKD, v_BTKD, q_seg=None, kv_seg=None, *, causal,
                        softmax_scale=None):
    """One block of a blockwise (ring) attention in jnp: (out [B, S, Hq, D], lse [B, Hq, S]
    float32, natural log), the contract of api.flash_block_fwd."""
    B, S, Hq, D = q_BSHD.shape
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    s_BKGST = _block_scores(q_BSHD, k_BTKD, q_seg, kv_seg, causal, scale)
    lse_BKGS = jax.nn.logsumexp(s_BKGST, axis=-1)
    p_BKGST = jnp.exp(s_BKGST - lse_BKGS[..., None]).astype(v_BTKD.dtype)
    o_BSKGD = jnp.einsum("bkgst,btkd->bskgd", p_BKGST, v_BTKD,
                         preferred_element_type=jnp.float32)
    return o_BSKGD.reshape(B, S, Hq, D).astype(q_BSHD.dtype), lse_BKGS.reshape(B, Hq, S)


def block_reference_bwd(q_BSHD, k_BTKD, v_BTKD, q_seg, kv_seg, out_BSHD, lse_BHS, do_BSHD, *,
                        causal, softmax_scale=None):
    """(dq, dk, dv) of one block from the whole row's out and natural-log lse (the contract of
    api.flash_block_bwd): the probabilities recomputed against the final lse, as
    FlashAttention-2's backward does, so the blocks' gradients sum to the exact one."""
    B, S, Hq, D = q_BSHD.shape
    Hkv = k_BTKD.shape[2]
    G = Hq // Hkv
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    s_BKGST = _block_scores(q_BSHD, k_BTKD, q_seg, kv_seg, causal, scale)
    p_BKGST = jnp.exp(s_BKGST - lse_BHS.reshape(B, Hkv, G, S)[..., None])
    do_BSKGD = do_BSHD.reshape(B, S, Hkv, G, D).astype(jnp.float32)
    delta_BKGS = jnp.einsum("bskgd,bskgd->bkgs", do_BSKGD,
                            out_BSHD.reshape(B, S, Hkv, G, D).astype(jnp.float32))
    dv = jnp.einsum("bkgst,bskgd->btkd", p_BKGST, do_BSKGD)
    dp_BKGST = jnp.einsum("bskgd,btkd->bkgst", do_BSKGD, v_BTKD.astype(jnp.float32))
    ds_BKGST = p_BKGST * (dp_BKGST - delta_BKGS[..., None]) * scale
    dq = jnp.einsum("bkgst,btkd->bskgd", ds_BKGST, k_BTKD.astype(jnp.float32))
    dk = jnp.einsum("bkgst,bskgd->btkd", ds_BKGST,
                    q_BSHD.reshape(B, S, Hkv, G, D).astype(jnp.float32))
    return (dq.reshape(B, S, Hq, D).astype(q_BSHD.dtype), dk.astype(k_BTKD.dtype),
            dv.astype(v_BTKD.dtype))
