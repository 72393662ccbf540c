"""flash_attention: one entry point, a custom_vjp around per-backend forward/backward kernels.

    flash_attention(q, k, v, *, causal=True, softmax_scale=None, segment_ids=None,
                    impl="auto", config=None, interpret=False)

q [B, S, Hq, D]; k, v [B, T, Hkv, D] with Hq a multiple of Hkv (GQA: K/V are never repeated
in memory); segment_ids [B, S] int (needs S == T) keep attention inside packed documents.
Any S and T: inputs are padded to whole blocks here and the padded keys masked in the kernels.
The forward saves the log-sum-exp; the backward recomputes P from it (FlashAttention-2).
flash_attention_fwd / flash_attention_bwd are the two halves of the Pallas impls, for callers
that run them separately (under jax.shard_map, as titanax.parallel.per_shard does).

impl: a name in backends.py's table (mosaic_sm90, mosaic_sm100, triton, cudnn, xla) or "auto"
(resolve.py: on GPU cuDNN unless measured.py records ours faster there, or segment ids / a
shard_map body rule cuDNN out; the choice and its reason are logged once).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..target import match_varying, target_platform
from .backends import IMPLS, KERNEL_IMPLS, backend, load
from .config import FlashConfig, default_config
from .reference import attention_reference, mask_SxT
from .resolve import resolve_impl, unsupported

__all__ = ["IMPLS", "PALLAS_IMPLS", "flash_attention", "flash_attention_bwd",
           "flash_attention_fwd", "flash_block_bwd", "flash_block_fwd", "mosaic_unsupported", "resolve_impl"]

PALLAS_IMPLS = KERNEL_IMPLS  # the backends with a Pallas kernel pair (own backward, per shard)


def mosaic_unsupported(impl: str, dtype, head_dim: int) -> str | None:
    """Why backend `impl` cannot take these inputs, or None when it can (the table's limits)."""
    return unsupported(impl, dtype, head_dim)


@functools.cache
def _kernels(impl: str):
    """(fwd, bwd, pad_multiples) of a Pallas backend, imported on first use."""
    b = backend(impl)
    return load(b.fwd), load(b.bwd), load(b.pad_multiples)


def flash_attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None,
                    segment_ids=None, impl: str = "auto", config: FlashConfig | None = None,
                    interpret: bool = False):
    seg, scale, impl, cfg = _prepare(q, k, v, segment_ids, softmax_scale, impl, config,
                                     interpret)
    if impl == "xla":
        return attention_reference(q, k, v, causal=causal, softmax_scale=scale, segment_ids=seg)
    if impl == "cudnn":
        mask = None
        if seg is not None:
            mask = mask_SxT(q.shape[1], k.shape[1], causal=False, segment_ids=seg)[:, None]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=causal,
            implementation="cudnn" if target_platform() == "gpu" else None)
    return _flash(q, k, v, seg, scale, causal, impl, cfg, interpret)


def flash_attention_fwd(q, k, v, segment_ids=None, *, causal: bool = True,
                        softmax_scale: float | None = None, impl: str = "auto",
                        config: FlashConfig | None = None, interpret: bool = False):
    """The forward of a Pallas impl alone: (out, lse), lse [B, Hq, S padded] being what
    flash_attention_bwd needs (in the kernel's own units). With the same arguments the pair is
    flash_attention and its VJP, for callers that place the two halves themselves (jax.shard_map
    in titanax.parallel.per_shard)."""
    seg, scale, impl, cfg = _prepare(q, k, v, segment_ids, softmax_scale, impl, config,
                                     interpret, pallas_only=True)
    return _forward(q, k, v, seg, scale, causal, impl, cfg, interpret)


def flash_attention_bwd(q, k, v, segment_ids, out, lse, do, *, causal: bool = True,
                        softmax_scale: float | None = None, impl: str = "auto",
                        config: FlashConfig | None = None, interpret: bool = False):
    """(dq, dk, dv) for flash_attention_fwd's (out, lse) and the output cotangent do."""
    seg, scale, impl, cfg = _prepare(q, k, v, segment_ids, softmax_scale, impl, config,
                                     interpret, pallas_only=True)
    return _backward(q, k, v, seg, out, lse, do, scale, causal, impl, cfg, interpret)


def flash_block_fwd(q, k, v, q_segment_ids=None, kv_segment_ids=None, *, causal: bool,
                    softmax_scale: float | None = None, impl: str = "auto",
                    config: FlashConfig | None = None, interpret: bool = False):
    """One block of a blockwise (ring) attention: queries against a block of keys that may be
    another part of the sequence (any S, T; causal needs S == T, the same positions).
    (out [B, S, Hq, D], lse [B, Hq, S] float32 in natural-log units, unpadded): blocks merge
    by their log-sum-exp whatever the backend's own units."""
    q_seg, kv_seg, scale, impl, cfg = _prepare_block(q, k, v, q_segment_ids, kv_segment_ids,
                                                     causal, softmax_scale, impl, config,
                                                     interpret)
    out, lse = _forward(q, k, v, q_seg, scale, causal, impl, cfg, interpret, kv_seg=kv_seg)
    lse = lse[:, :, :q.shape[1]]
    return out, lse * _LN2 if backend(impl).lse_log2 else lse


def flash_block_bwd(q, k, v, q_segment_ids, kv_segment_ids, out, lse, do, *, causal: bool,
                    softmax_scale: float | None = None, impl: str = "auto",
                    config: FlashConfig | None = None, interpret: bool = False):
    """(dq, dk, dv) of one block given the whole row's out and natural-log lse [B, Hq, S]
    (the merge of every block): FlashAttention-2's backward recomputes this block's
    probabilities from the final lse, so the blocks' gradients sum to the exact gradient."""
    q_seg, kv_seg, scale, impl, cfg = _prepare_block(q, k, v, q_segment_ids, kv_segment_ids,
                                                     causal, softmax_scale, impl, config,
                                                     interpret)
    lse = lse / _LN2 if backend(impl).lse_log2 else lse
    # Padded query rows: lse 0 keeps their recomputed probabilities finite; their dO is 0.
    lse = _pad_to(lse, 2, _padded_lengths(q, k, impl, cfg)[0])
    return _backward(q, k, v, q_seg, out, lse, do, scale, causal, impl, cfg, interpret,
                     kv_seg=kv_seg)


_LN2 = 0.6931471805599453


def _prepare_block(q, k, v, q_seg, kv_seg, causal, softmax_scale, impl, config, interpret):
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"a causal block needs queries and keys at the same positions; got "
                         f"S={q.shape[1]}, T={k.shape[1]}")
    if (q_seg is None) != (kv_seg is None):
        raise ValueError("pass segment ids for both queries and keys, or for neither")
    if q_seg is not None and (q_seg.shape != q.shape[:2] or kv_seg.shape != k.shape[:2]):
        raise ValueError(f"segment ids {q_seg.shape}, {kv_seg.shape} must be [B, S] "
                         f"{q.shape[:2]} and [B, T] {k.shape[:2]}")
    # _prepare checks shapes and resolves the impl; segment ids are checked above instead.
    _, scale, impl, cfg = _prepare(q, k, v, None, softmax_scale, impl, config, interpret,
                                   pallas_only=True, segmented=q_seg is not None)
    as_int = lambda s: None if s is None else s.astype(jnp.int32)
    return as_int(q_seg), as_int(kv_seg), scale, impl, cfg


def _prepare(q, k, v, segment_ids, softmax_scale, impl, config, interpret, pallas_only=False,
             segmented=None):
    """Checks the inputs; (segment ids as int32, scale, resolved impl, kernel config)."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"expected q [B,S,Hq,D], k=v [B,T,Hkv,D]; got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    B, S, Hq, D = q.shape
    _, T, Hkv, Dk = k.shape
    if k.shape[0] != B or Dk != D:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape} in batch or head_dim")
    if Hq % Hkv:
        raise ValueError(f"q heads {Hq} must be a multiple of kv heads {Hkv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if segment_ids is not None:
        if S != T or segment_ids.shape != (B, S):
            raise ValueError(f"segment_ids must be [B, S] = {(B, S)} with S == T; got "
                             f"{segment_ids.shape}, T={T}")
        segment_ids = segment_ids.astype(jnp.int32)
    scale = float(D ** -0.5 if softmax_scale is None else softmax_scale)
    segmented = segment_ids is not None if segmented is None else segmented
    impl = resolve_impl(impl, q.dtype, D, interpret=interpret, segment_ids=segmented)
    if impl not in PALLAS_IMPLS:
        if pallas_only:
            raise ValueError(f"flash_attention_fwd/bwd run the Pallas impls {PALLAS_IMPLS}; "
                             f"impl resolved to {impl!r}: call flash_attention instead")
        return segment_ids, scale, impl, None
    why = unsupported(impl, q.dtype, D)
    if why:
        raise ValueError(why)
    cfg = config if config is not None else default_config(impl, D, interpret=interpret)
    if backend(impl).mosaic:
        cfg.check_mosaic()
    return segment_ids, scale, impl, cfg


def _pad_to(x, axis: int, n: int, mode: str = "constant"):
    if x.shape[axis] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad, mode=mode)


def _pad_segments(seg, n: int):
    """Segment ids padded by repeating the last one: padded rows join the last document
    instead of a new id, so the tile ranges (tile_ranges.py) of the last tile stay tight.
    Padded keys are masked by kv_len; padded query rows are dropped (dO = 0 for them)."""
    return _pad_to(seg, 1, n, mode="edge")


def _padded_lengths(q, k, impl, cfg):
    mq, mk = _kernels(impl)[2](cfg)
    return -(-q.shape[1] // mq) * mq, -(-k.shape[1] // mk) * mk


def _forward(q, k, v, seg, scale, causal, impl, cfg, interpret, kv_seg=None):
    """Pads to whole blocks, runs the kernel, slices: (out, lse [B, Hq, Sp]). kv_seg: the
    keys' segment ids when they are not the queries' own (context parallelism's blocks)."""
    Sp, Tp = _padded_lengths(q, k, impl, cfg)
    kv_seg = seg if kv_seg is None else kv_seg
    # Pad values are irrelevant: padded keys are masked by kv_len.
    q_seg, kv_seg = (None, None) if seg is None else (_pad_segments(seg, Sp),
                                                      _pad_segments(kv_seg, Tp))
    out, lse = _kernels(impl)[0](_pad_to(q, 1, Sp), _pad_to(k, 1, Tp), _pad_to(v, 1, Tp),
                                 q_seg, kv_seg, scale=scale, causal=causal, kv_len=k.shape[1],
                                 config=cfg, interpret=interpret)
    # Inside jax.shard_map, Mosaic GPU kernels return values typed as invariant (plgpu.kernel
    # turns the check off); they vary like q.
    return match_varying(out[:, :q.shape[1]], q), match_varying(lse, q)


def _backward(q, k, v, seg, out, lse, do, scale, causal, impl, cfg, interpret, kv_seg=None):
    S, T = q.shape[1], k.shape[1]
    Sp, Tp = _padded_lengths(q, k, impl, cfg)
    kv_seg = seg if kv_seg is None else kv_seg
    q_seg, kv_seg = (None, None) if seg is None else (_pad_segments(seg, Sp),
                                                      _pad_segments(kv_seg, Tp))
    # Padded query rows get dO = 0, so delta = 0 and they add nothing to dK/dV. A cotangent
    # may arrive invariant inside shard_map (e.g. of a sum): it varies like out.
    do = match_varying(do, out)
    dq, dk, dv = _kernels(impl)[1](
        _pad_to(q, 1, Sp), _pad_to(k, 1, Tp), _pad_to(v, 1, Tp), _pad_to(out, 1, Sp), lse,
        _pad_to(do, 1, Sp), q_seg, kv_seg, scale=scale, causal=causal, kv_len=T, config=cfg,
        interpret=interpret)
    return (match_varying(dq[:, :S], q), match_varying(dk[:, :T], k),
            match_varying(dv[:, :T], v))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _flash(q, k, v, seg, scale, causal, impl, cfg, interpret):
    return _forward(q, k, v, seg, scale, causal, impl, cfg, interpret)[0]


def _flash_fwd(q, k, v, seg, scale, causal, impl, cfg, interpret):
    out, lse = _forward(q, k, v, seg, scale, causal, impl, cfg, interpret)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(scale, causal, impl, cfg, interpret, res, do):
    q, k, v, seg, out, lse = res
    return (*_backward(q, k, v, seg, out, lse, do, scale, causal, impl, cfg, interpret), None)


_flash.defvjp(_flash_fwd, _flash_bwd)
