"""Flash attention forward as a Pallas grid kernel (Triton backend; interpret mode on CPU).

Grid (q blocks, batch, q heads). Each program keeps one [block_q, D] query tile and streams
the K/V of its kv head (q head // group: GQA without copying K/V) in block_kv tiles with the
online softmax of FlashAttention-2, then writes the output tile and the log-sum-exp (natural
log, float32) that the backward pass needs. Inputs arrive padded to whole blocks; keys at or
beyond kv_len are masked, padded query rows are computed and dropped by the caller.

With segment ids (packed documents) a program visits only the key tiles [lo, hi) that
tile_ranges.py computes in XLA for its query tile, handed in as four scalars, and builds no
mask on [full_lo, full_hi), the tiles wholly inside the query tile's one document. A query
tile with no visible key tile writes zeros and lse MASK_VALUE (finite).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..target import compute_capability, out_struct
from .mask import MASK_VALUE
from .tile_ranges import FULL_HI, FULL_LO, HI, LO, tile_ranges


def pad_multiples(cfg):
    """Sequence multiples the grid kernels need: whole forward and backward blocks."""
    return max(cfg.block_q, cfg.block_q_bwd), max(cfg.block_kv, cfg.block_kv_bwd)


def dot(a, b, *, trans_a=False, trans_b=False):
    """a @ b (a^T, b^T on request) accumulated in float32; fp32 inputs stay fp32 (no tf32)."""
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def block_mask(q_pos, k_pos, *, causal, kv_len, kv_len_padded, q_seg=None, k_seg=None):
    """[bq, bk] visibility of one tile, or None when every entry is visible."""
    mask = None
    def _and(m, new):
        return new if m is None else m & new
    if causal:
        mask = _and(mask, k_pos[None, :] <= q_pos[:, None])
    if kv_len != kv_len_padded:
        mask = _and(mask, jnp.broadcast_to(k_pos[None, :] < kv_len, (q_pos.size, k_pos.size)))
    if q_seg is not None:
        mask = _and(mask, q_seg[:, None] == k_seg[None, :])
    return mask


def visible_tiles(ranges_ref, body, carry, *, split: bool):
    """body(t, carry, masked) over a row tile's column tiles [lo, hi) (tile_ranges.py), with no
    mask on [full_lo, full_hi), the tiles wholly inside the row tile's one document.

    split: three loops (masked, unmasked, masked), `masked` a Python bool; the forward and dq
    kernels on Hopper (split_loops). Otherwise one loop deciding the mask per tile (a traced
    bool: mask_scores' lax.cond): three copies of the dkv kernel's body spill at head_dim 128,
    and the forward's at 256 on sm_100. (A two-pass loop emitting each body once spilled
    more.)"""
    lo, full_lo, full_hi, hi = (ranges_ref[r] for r in (LO, FULL_LO, FULL_HI, HI))
    if not split:
        return lax.fori_loop(
            lo, hi, lambda t, c: body(t, c, masked=(t < full_lo) | (t >= full_hi)), carry)
    carry = lax.fori_loop(lo, full_lo, lambda t, c: body(t, c, masked=True), carry)
    carry = lax.fori_loop(full_lo, full_hi, lambda t, c: body(t, c, masked=False), carry)
    return lax.fori_loop(full_hi, hi, lambda t, c: body(t, c, masked=True), carry)


def split_loops() -> bool:
    """Whether the forward and dq kernels run the masked and unmasked tiles in loops of their
    own (visible_tiles' split): on Hopper, where Triton's dots are wgmma and a branch inside
    the loop serializes them (ptxas C7515). Elsewhere one loop: on sm_100 three loops spill
    the forward at head_dim 256. (Tests set both on the CPU.)"""
    cc = compute_capability()
    return cc is not None and cc[0] == 9


def mask_scores(s, masked, make_mask):
    """s with the entries make_mask() hides at MASK_VALUE. masked: a Python bool, or a traced
    one deciding per tile (lax.cond, so that the unmasked tiles build no mask)."""
    def apply(s):
        mask = make_mask()
        return s if mask is None else jnp.where(mask, s, MASK_VALUE)
    if isinstance(masked, bool):
        return apply(s) if masked else s
    return lax.cond(masked, apply, lambda s: s, s)


def segment_refs(rest, has_segments: bool):
    """A grid kernel's refs after its inputs -> ((query ids, key ids, tile ranges), outputs):
    the three segment operands come first, and only with documents (else three Nones)."""
    return (rest[:3], rest[3:]) if has_segments else ((None, None, None), rest)


def _fwd_kernel(q_ref, k_ref, v_ref, *rest, scale, causal, block_q, block_kv, kv_len,
                has_segments, split):
    (qseg_ref, kseg_ref, ranges_ref), (o_ref, lse_ref) = segment_refs(rest, has_segments)
    kv_len_padded = k_ref.shape[0]
    qi = pl.program_id(0)
    q = q_ref[...]
    q_pos = qi * block_q + jnp.arange(block_q)
    q_seg = qseg_ref[...] if has_segments else None

    def body(j, carry, masked=True):
        o, m, l = carry
        ks = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        k = k_ref[ks, :]
        s = dot(q, k, trans_b=True) * scale  # scale before masking: MASK_VALUE * scale overflows
        k_pos = j * block_kv + jnp.arange(block_kv)
        s = mask_scores(s, masked, lambda: block_mask(
            q_pos, k_pos, causal=causal, kv_len=kv_len, kv_len_padded=kv_len_padded,
            q_seg=q_seg, k_seg=kseg_ref[ks] if has_segments else None))
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = alpha * l + p.sum(axis=-1)
        v = v_ref[ks, :]
        o = alpha[:, None] * o + dot(p.astype(v.dtype), v)
        return o, m_new, l

    n_kv = kv_len_padded // block_kv
    if causal:  # blocks wholly above the diagonal contribute nothing
        hi = jnp.minimum(lax.div((qi + 1) * block_q + block_kv - 1, block_kv), n_kv)
    else:
        hi = n_kv
    D = q_ref.shape[-1]
    # m starts at MASK_VALUE (not -inf): a row masked so far has p = 1 on masked keys, wiped by
    # alpha = exp(MASK_VALUE - m) = 0 at its first visible key; no inf - inf NaNs anywhere.
    init = (jnp.zeros((block_q, D), jnp.float32), jnp.full((block_q,), MASK_VALUE, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    if has_segments:  # only the key tiles that hold a key this query tile may see
        o, m, l = visible_tiles(ranges_ref, body, init, split=split)
        # No tile visited (lo == hi): l = 0; zeros out and lse = MASK_VALUE, finite.
        l = jnp.where(l == 0, 1.0, l)
    else:
        o, m, l = lax.fori_loop(0, hi, body, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def flash_fwd(q, k, v, q_seg, kv_seg, *, scale, causal, kv_len, config, interpret):
    """Padded q [B, Sp, Hq, D], k/v [B, Tp, Hkv, D] -> (out like q, lse [B, Hq, Sp] f32)."""
    B, Sp, Hq, D = q.shape
    Tp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = config.block_q, config.block_kv
    has_segments = q_seg is not None
    kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, block_q=bq,
                               block_kv=bk, kv_len=kv_len, has_segments=has_segments,
                               split=split_loops())
    in_specs = [
        pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, Tp, None, D), lambda i, b, h: (b, 0, h // G, 0)),
        pl.BlockSpec((None, Tp, None, D), lambda i, b, h: (b, 0, h // G, 0)),
    ]
    args = [q, k, v]
    if has_segments:
        ranges = tile_ranges(q_seg, kv_seg, rows=bq, cols=bk, causal=causal, kv_len=kv_len)
        in_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, Tp), lambda i, b, h: (b, 0)),
                     pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0))]
        args += [q_seg, kv_seg, ranges]
    num_warps = config.num_warps or (4 if D <= 64 else 8)
    return pl.pallas_call(
        kernel,
        grid=(Sp // bq, B, Hq),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[out_struct(q, q.shape, q.dtype), out_struct(q, (B, Hq, Sp), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps,
                                                num_stages=config.num_stages),
        interpret=interpret,
        name="titanax_flash_fwd",
    )(*args)
