"""What every Pallas kernel pair of the table shares: padding to whole blocks, the custom_vjp
around a forward and a backward kernel, the two halves apart (for callers that place them
under jax.shard_map) and one block of context parallelism's blockwise attention.

A kernel pair is three "module:function"s in its table entry (backends.kernel_pair): fwd and bwd
take padded inputs (the signature of kernel_fwd.flash_fwd / kernel_bwd.flash_bwd), and
pad_multiples(config) says to what (query, key) multiples. The forward saves the log-sum-exp;
the backward recomputes P from it (FlashAttention-2). Padded keys are masked by kv_len in the
kernels; padded query rows are dropped (their dO is 0).
"""

from __future__ import annotations

import functools

import jax

from ..target import match_varying
from .backends import backend, load
from .mask import Mask

_LN2 = 0.6931471805599453


@functools.cache
def _kernels(impl: str):
    """(fwd, bwd, pad_multiples) of a Pallas backend, imported on first use."""
    b = backend(impl)
    return load(b.fwd), load(b.bwd), load(b.pad_multiples)


def attention(q_BSHK, k_BTNK, v_BTNK, mask: Mask, *, softmax_scale: float, impl: str, config,
              interpret: bool = False):
    """The table's one signature for every kernel pair: out [B, S, H, K], differentiable.
    mask: causal and the queries' own segment ids (Mask.general is for other backends)."""
    return _flash(q_BSHK, k_BTNK, v_BTNK, mask.segment_ids, softmax_scale, mask.causal, impl,
                  config, interpret)


def block_fwd(q_BSHK, k_BTNK, v_BTNK, q_seg=None, kv_seg=None, *, causal: bool,
              softmax_scale: float, impl: str, config, interpret: bool = False):
    """(out, lse [B, H, S] float32 in natural-log units, unpadded): blocks merge by their
    log-sum-exp whatever the kernel's own units."""
    out, lse = forward(q_BSHK, k_BTNK, v_BTNK, q_seg, causal=causal, softmax_scale=softmax_scale,
                       impl=impl, config=config, interpret=interpret, kv_seg=kv_seg)
    lse = lse[:, :, :q_BSHK.shape[1]]
    return out, lse * _LN2 if backend(impl).lse_log2 else lse


def block_bwd(q_BSHK, k_BTNK, v_BTNK, q_seg, kv_seg, out_BSHK, lse_BHS, do_BSHK, *,
              causal: bool, softmax_scale: float, impl: str, config, interpret: bool = False):
    """(dq, dk, dv) of one block given the whole row's out and natural-log lse."""
    lse = lse_BHS / _LN2 if backend(impl).lse_log2 else lse_BHS
    # Padded query rows: lse 0 keeps their recomputed probabilities finite; their dO is 0.
    lse = _pad_to(lse, 2, _padded_lengths(q_BSHK, k_BTNK, impl, config)[0])
    return backward(q_BSHK, k_BTNK, v_BTNK, q_seg, out_BSHK, lse, do_BSHK, causal=causal,
                    softmax_scale=softmax_scale, impl=impl, config=config, interpret=interpret,
                    kv_seg=kv_seg)


def _pad_to(x, axis: int, n: int, mode: str = "constant"):
    if x.shape[axis] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jax.numpy.pad(x, pad, mode=mode)


def _pad_segments(seg, n: int):
    """Segment ids padded by repeating the last one: padded rows join the last document
    instead of a new id, so the tile ranges (tile_ranges.py) of the last tile stay tight.
    Padded keys are masked by kv_len; padded query rows are dropped (dO = 0 for them)."""
    return None if seg is None else _pad_to(seg, 1, n, mode="edge")


def _padded_lengths(q, k, impl, cfg):
    mq, mk = _kernels(impl)[2](cfg)
    return -(-q.shape[1] // mq) * mq, -(-k.shape[1] // mk) * mk


def forward(q, k, v, seg, *, causal, softmax_scale, impl, config, interpret, kv_seg=None):
    """Pads to whole blocks, runs the kernel, slices: (out, lse [B, H, S padded]) in the
    kernel's own units. kv_seg: the keys' segment ids when they are not the queries' own
    (context parallelism's blocks)."""
    Sp, Tp = _padded_lengths(q, k, impl, config)
    kv_seg = seg if kv_seg is None else kv_seg
    # Pad values are irrelevant: padded keys are masked by kv_len.
    out, lse = _kernels(impl)[0](_pad_to(q, 1, Sp), _pad_to(k, 1, Tp), _pad_to(v, 1, Tp),
                                 _pad_segments(seg, Sp), _pad_segments(kv_seg, Tp),
                                 scale=softmax_scale, causal=causal, kv_len=k.shape[1],
                                 config=config, interpret=interpret)
    # Inside jax.shard_map, Mosaic GPU kernels return values typed as invariant (plgpu.kernel
    # turns the check off); they vary like q.
    return match_varying(out[:, :q.shape[1]], q), match_varying(lse, q)


def backward(q, k, v, seg, out, lse, do, *, causal, softmax_scale, impl, config, interpret,
             kv_seg=None):
    """(dq, dk, dv) for forward's (out, lse) and the output cotangent do."""
    S, T = q.shape[1], k.shape[1]
    Sp, Tp = _padded_lengths(q, k, impl, config)
    kv_seg = seg if kv_seg is None else kv_seg
    # Padded query rows get dO = 0, so delta = 0 and they add nothing to dK/dV. A cotangent
    # may arrive invariant inside shard_map (e.g. of a sum): it varies like out.
    do = match_varying(do, out)
    dq, dk, dv = _kernels(impl)[1](
        _pad_to(q, 1, Sp), _pad_to(k, 1, Tp), _pad_to(v, 1, Tp), _pad_to(out, 1, Sp), lse,
        _pad_to(do, 1, Sp), _pad_segments(seg, Sp), _pad_segments(kv_seg, Tp),
        scale=softmax_scale, causal=causal, kv_len=T, config=config, interpret=interpret)
    return (match_varying(dq[:, :S], q), match_varying(dk[:, :T], k),
            match_varying(dv[:, :T], v))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _flash(q, k, v, seg, scale, causal, impl, cfg, interpret):
    return forward(q, k, v, seg, causal=causal, softmax_scale=scale, impl=impl, config=cfg,
                   interpret=interpret)[0]


def _flash_fwd(q, k, v, seg, scale, causal, impl, cfg, interpret):
    out, lse = forward(q, k, v, seg, causal=causal, softmax_scale=scale, impl=impl, config=cfg,
                       interpret=interpret)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(scale, causal, impl, cfg, interpret, res, do):
    q, k, v, seg, out, lse = res
    return (*backward(q, k, v, seg, out, lse, do, causal=causal, softmax_scale=scale,
                      impl=impl, config=cfg, interpret=interpret), None)


_flash.defvjp(_flash_fwd, _flash_bwd)
