"""Flash attention backward as Pallas grid kernels (Triton backend; interpret mode on CPU).

FlashAttention-2's split: delta = rowsum(dO * O) in XLA, then two kernels that each recompute
P = exp(S - lse) from the saved log-sum-exp, so nothing quadratic is stored.
  dq:  grid (q blocks, batch, q heads); streams K/V blocks of the kv head.
  dkv: grid (kv blocks, batch, kv heads); streams Q/dO blocks of all `group` q heads that share
       this kv head and sums their contributions in registers, so GQA needs no [B, T, Hq, D]
       temporaries and no reduction afterwards.
With segment ids both visit only the tiles tile_ranges.py gives (dq: key tiles per query tile;
dkv: query tiles per key tile, transposed=True), unmasked inside one document, as the forward.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ..target import out_struct
from .kernel_fwd import block_mask, dot, mask_scores, segment_refs, split_loops, visible_tiles
from .tile_ranges import tile_ranges


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, scale, causal,
               block_q, block_kv, kv_len, has_segments, split):
    (qseg_ref, kseg_ref, ranges_ref), (dq_ref,) = segment_refs(rest, has_segments)
    kv_len_padded = k_ref.shape[0]
    qi = pl.program_id(0)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_pos = qi * block_q + jnp.arange(block_q)
    q_seg = qseg_ref[...] if has_segments else None

    def body(j, dq, masked=True):
        ks = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s = mask_scores(dot(q, k, trans_b=True) * scale, masked, lambda: block_mask(
            q_pos, j * block_kv + jnp.arange(block_kv), causal=causal, kv_len=kv_len,
            kv_len_padded=kv_len_padded, q_seg=q_seg,
            k_seg=kseg_ref[ks] if has_segments else None))
        p = jnp.exp(s - lse[:, None])
        dp = dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k)

    n_kv = kv_len_padded // block_kv
    hi = (jnp.minimum(lax.div((qi + 1) * block_q + block_kv - 1, block_kv), n_kv)
          if causal else n_kv)
    dq = jnp.zeros(q.shape, jnp.float32)
    if has_segments:  # masked, unmasked, masked runs of the visible key tiles
        dq = visible_tiles(ranges_ref, body, dq, split=split)
    else:
        dq = lax.fori_loop(0, hi, body, dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest, scale, causal,
                block_q, block_kv, kv_len, kv_len_padded, group, has_segments):
    (qseg_ref, kseg_ref, ranges_ref), (dk_ref, dv_ref) = segment_refs(rest, has_segments)
    q_len_padded = q_ref.shape[0]
    kj = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    k_pos = kj * block_kv + jnp.arange(block_kv)
    k_seg = kseg_ref[...] if has_segments else None
    n_q = q_len_padded // block_q
    # Query blocks wholly before this key block cannot see it under the causal mask.
    lo = lax.div(kj * block_kv, block_q) if causal else 0

    def q_body(i, carry, g, masked=True):
        dk, dv = carry
        qs = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
        q, do = q_ref[qs, g, :], do_ref[qs, g, :]
        lse, delta = lse_ref[g, qs], delta_ref[g, qs]
        s = mask_scores(dot(q, k, trans_b=True) * scale, masked, lambda: block_mask(
            i * block_q + jnp.arange(block_q), k_pos, causal=causal, kv_len=kv_len,
            kv_len_padded=kv_len_padded, q_seg=qseg_ref[qs] if has_segments else None,
            k_seg=k_seg))
        p = jnp.exp(s - lse[:, None])  # [bq, bk]
        dv = dv + dot(p.astype(do.dtype), do, trans_a=True)
        dp = dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])
        dk = dk + dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    def g_body(g, carry):
        if has_segments:  # the query tiles that see this key tile
            return visible_tiles(ranges_ref, functools.partial(q_body, g=g), carry, split=False)
        return lax.fori_loop(lo, n_q, functools.partial(q_body, g=g), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, group, g_body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def flash_bwd(q, k, v, o, lse, do, q_seg, kv_seg, *, scale, causal, kv_len, config, interpret):
    """Padded inputs as flash_fwd's, o/do like q, lse [B, Hq, Sp] -> (dq, dk, dv)."""
    B, Sp, Hq, D = q.shape
    Tp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = config.block_q_bwd, config.block_kv_bwd
    has_segments = q_seg is not None
    # delta_i = sum_d dO_id O_id: one fused XLA reduction, read once per kernel program.
    delta = jnp.einsum("bshd,bshd->bhs", o.astype(jnp.float32), do.astype(jnp.float32))
    num_warps = config.num_warps or (4 if D <= 64 else 8)
    stages = config.num_stages if config.num_stages_bwd is None else config.num_stages_bwd
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=stages)
    static = dict(scale=scale, causal=causal, block_q=bq, block_kv=bk, kv_len=kv_len,
                  has_segments=has_segments)

    dq_specs = [
        pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),   # q
        pl.BlockSpec((None, Tp, None, D), lambda i, b, h: (b, 0, h // G, 0)),  # k
        pl.BlockSpec((None, Tp, None, D), lambda i, b, h: (b, 0, h // G, 0)),  # v
        pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),   # do
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),         # lse
        pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),         # delta
    ]
    args = [q, k, v, do, lse, delta]
    dq_args, dkv_args = args, args
    if has_segments:
        ranges = functools.partial(tile_ranges, q_seg, kv_seg, causal=causal, kv_len=kv_len)
        dq_specs += [pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, Tp), lambda i, b, h: (b, 0)),
                     pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0))]
        dq_args = args + [q_seg, kv_seg, ranges(rows=bq, cols=bk)]
        dkv_args = args + [q_seg, kv_seg, ranges(rows=bk, cols=bq, transposed=True)]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, split=split_loops(), **static),
        grid=(Sp // bq, B, Hq),
        in_specs=dq_specs,
        out_specs=pl.BlockSpec((None, bq, None, D), lambda i, b, h: (b, i, h, 0)),
        out_shape=out_struct(q, q.shape, q.dtype),
        compiler_params=params, interpret=interpret, name="titanax_flash_bwd_dq",
    )(*dq_args)

    # The G q heads of kv head h are h*G .. h*G+G-1: one block of G along the head axis.
    dkv_specs = [
        pl.BlockSpec((None, Sp, G, D), lambda j, b, h: (b, 0, h, 0)),      # q
        pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0)),   # k
        pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0)),   # v
        pl.BlockSpec((None, Sp, G, D), lambda j, b, h: (b, 0, h, 0)),      # do
        pl.BlockSpec((None, G, Sp), lambda j, b, h: (b, h, 0)),            # lse
        pl.BlockSpec((None, G, Sp), lambda j, b, h: (b, h, 0)),            # delta
    ]
    if has_segments:
        dkv_specs += [pl.BlockSpec((None, Sp), lambda j, b, h: (b, 0)),
                      pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
                      pl.BlockSpec((None, None, 4), lambda j, b, h: (b, j, 0))]
    kv_spec = pl.BlockSpec((None, bk, None, D), lambda j, b, h: (b, j, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, group=G, kv_len_padded=Tp, **static),
        grid=(Tp // bk, B, Hkv),
        in_specs=dkv_specs,
        out_specs=[kv_spec, kv_spec],
        out_shape=[out_struct(k, k.shape, k.dtype), out_struct(v, v.shape, v.dtype)],
        compiler_params=params, interpret=interpret, name="titanax_flash_bwd_dkv",
    )(*dkv_args)
    return dq, dk, dv
