"""The `xla` backend, and THE reference every backend is tested against: one implementation.

q_BSHK [B, S, H, K], k/v_BTNK [B, T, N, K], H a multiple of N (G = H / N query heads share a
key/value head; K/V are never repeated in memory); any Mask (mask.py), decoding included.
Scores and softmax in float32; masked scores take MASK_VALUE, so a fully masked row stays
finite (it averages every value), exactly as the kernels do.

Both products are one batched matmul over P = B * N (a batch row and a kv head), the G query
heads of a kv head stacked along Q = G * S rows: XLA:CPU runs this ~25% faster (forward and
backward) than 5-D einsums. Causal self-attention skips the masked-out key blocks: up to 8
query chunks of at least 64 positions, chunk i attending to keys [0, (i+1) S / chunks) alone
(8 chunks: 56% of the full score work).

attention_reference is the same function by keywords, at Precision.HIGHEST (what tests and
launch.gpu_check compare against); block_reference_fwd / _bwd are one block of context
parallelism's blockwise attention (api.flash_block_fwd / _bwd's contract).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .mask import MASK_VALUE, Mask


def attention(q_BSHK, k_BTNK, v_BTNK, mask: Mask, *, softmax_scale: float, impl=None,
              config=None, interpret=False, precision=None, return_lse: bool = False):
    """out [B, S, H, K] in q's dtype (and lse [B, H, S] float32, natural log, with
    return_lse). impl, config, interpret: the table's one signature (unused here)."""
    del impl, config, interpret
    B, S, H, K = q_BSHK.shape
    T, N = k_BTNK.shape[1], k_BTNK.shape[2]
    G = H // N
    q_PGSK = q_BSHK.reshape(B, S, N, G, K).transpose(0, 2, 3, 1, 4).reshape(B * N, G, S, K)
    k_PTK = k_BTNK.transpose(0, 2, 1, 3).reshape(B * N, T, K)
    v_PTK = v_BTNK.transpose(0, 2, 1, 3).reshape(B * N, T, K)
    dense = mask.dense(S, T)
    chunks = min(8, S // 64) if mask.causal and not mask.general and S == T else 1
    chunks = chunks if chunks > 1 and S % chunks == 0 else 1
    C = S // chunks
    outs, lses = [], []
    for i in range(chunks):
        end = T if chunks == 1 else (i + 1) * C
        out, lse = _attend(q_PGSK[:, :, i * C:(i + 1) * C].reshape(B * N, G * C, K),
                           k_PTK[:, :end], v_PTK[:, :end], dense[:, :, i * C:(i + 1) * C, :end],
                           B, N, G, softmax_scale, precision)
        outs.append(out.reshape(B * N, G, C, K))
        lses.append(lse.reshape(B * N, G, C))
    out_PGSK = jnp.concatenate(outs, axis=2)
    out_BSHK = out_PGSK.reshape(B, N, G, S, K).transpose(0, 3, 1, 2, 4).reshape(B, S, H, K)
    out_BSHK = out_BSHK.astype(q_BSHK.dtype)
    if return_lse:
        return out_BSHK, jnp.concatenate(lses, axis=2).reshape(B, H, S)
    return out_BSHK


def _attend(q_PQK, k_PTK, v_PTK, mask, B, N, G, softmax_scale, precision):
    """softmax(q k^T) v with q rows ordered (group, position): [P, Q, K] -> ([P, Q, K] float32,
    lse [P, Q]). mask: [B|1, 1, S, T], broadcast over kv heads and the group axis."""
    P, Q, K = q_PQK.shape
    S, T = Q // G, k_PTK.shape[1]
    s_PQT = jnp.einsum("pqk,ptk->pqt", q_PQK, k_PTK, precision=precision,
                       preferred_element_type=jnp.float32) * softmax_scale
    s_BNGST = jnp.where(mask[:, :, None], s_PQT.reshape(B, N, G, S, T), MASK_VALUE)
    # Softmax with the normalisation deferred to the [.., K] output (a pass over [.., T]
    # fewer, forward and backward; 17% of the attention time on XLA:CPU): the row max is a
    # constant shift (no gradient), exp, then (p v) / sum(p).
    shift = jax.lax.stop_gradient(jnp.max(s_BNGST, axis=-1, keepdims=True))
    p_BNGST = jnp.exp(s_BNGST - shift)
    denom_BNGS1 = jnp.sum(p_BNGST, axis=-1, keepdims=True)
    out_PQK = jnp.einsum("pqt,ptk->pqk", p_BNGST.astype(v_PTK.dtype).reshape(P, Q, T), v_PTK,
                         precision=precision, preferred_element_type=jnp.float32)
    lse_PQ = (shift + jnp.log(denom_BNGS1)).reshape(P, Q)
    return out_PQK / denom_BNGS1.reshape(P, Q, 1), lse_PQ


def attention_reference(q_BSHK, k_BTNK, v_BTNK, *, causal=True, softmax_scale=None,
                        segment_ids=None, return_lse=False):
    """`attention` by keywords at full float32 precision: what every backend is tested
    against."""
    scale = q_BSHK.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return attention(q_BSHK, k_BTNK, v_BTNK, Mask(causal, segment_ids), softmax_scale=scale,
                     precision=jax.lax.Precision.HIGHEST, return_lse=return_lse)


def block_reference_fwd(q_BSHK, k_BTNK, v_BTNK, q_seg=None, kv_seg=None, *, causal,
                        softmax_scale=None, impl=None, config=None, interpret=False):
    """One block of a blockwise (ring) attention: (out [B, S, H, K], lse [B, H, S] float32,
    natural log), the contract of api.flash_block_fwd."""
    scale = q_BSHK.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    return attention(q_BSHK, k_BTNK, v_BTNK, Mask(causal, q_seg, kv_seg),
                     softmax_scale=scale, return_lse=True)


def block_reference_bwd(q_BSHK, k_BTNK, v_BTNK, q_seg, kv_seg, out_BSHK, lse_BHS, do_BSHK, *,
                        causal, softmax_scale=None, impl=None, config=None, interpret=False):
    """(dq, dk, dv) of one block from the whole row's out and natural-log lse (the contract of
    api.flash_block_bwd): the probabilities recomputed against the final lse, as
    FlashAttention-2's backward does, so the blocks' gradients sum to the exact one."""
    B, S, H, K = q_BSHK.shape
    T, N = k_BTNK.shape[1], k_BTNK.shape[2]
    G = H // N
    scale = K ** -0.5 if softmax_scale is None else softmax_scale
    f32 = lambda x: x.reshape(B, S, N, G, K).astype(jnp.float32)
    q_BSNGK, do_BSNGK, out_BSNGK = f32(q_BSHK), f32(do_BSHK), f32(out_BSHK)
    k_BTNK32, v_BTNK32 = k_BTNK.astype(jnp.float32), v_BTNK.astype(jnp.float32)
    s_BNGST = jnp.einsum("bsngk,btnk->bngst", q_BSNGK, k_BTNK32) * scale
    mask = Mask(causal, q_seg, kv_seg).dense(S, T)[:, :, None]
    s_BNGST = jnp.where(mask, s_BNGST, MASK_VALUE)
    p_BNGST = jnp.exp(s_BNGST - lse_BHS.reshape(B, N, G, S)[..., None])
    delta_BNGS = jnp.einsum("bsngk,bsngk->bngs", do_BSNGK, out_BSNGK)
    dv_BTNK = jnp.einsum("bngst,bsngk->btnk", p_BNGST, do_BSNGK)
    dp_BNGST = jnp.einsum("bsngk,btnk->bngst", do_BSNGK, v_BTNK32)
    ds_BNGST = p_BNGST * (dp_BNGST - delta_BNGS[..., None]) * scale
    dq_BSNGK = jnp.einsum("bngst,btnk->bsngk", ds_BNGST, k_BTNK32)
    dk_BTNK = jnp.einsum("bngst,bsngk->btnk", ds_BNGST, q_BSNGK)
    return (dq_BSNGK.reshape(B, S, H, K).astype(q_BSHK.dtype), dk_BTNK.astype(k_BTNK.dtype),
            dv_BTNK.astype(v_BTNK.dtype))
