"""flash_attention: one entry point, a custom_vjp around per-backend forward/backward kernels.

    flash_attention(q, k, v, *, causal=True, softmax_scale=None, segment_ids=None,
                    impl="auto", config=None, interpret=False)

q [B, S, Hq, D]; k, v [B, T, Hkv, D] with Hq a multiple of Hkv (GQA: K/V are never repeated
in memory); segment_ids [B, S] int (needs S == T) keep attention inside packed documents.
Any S and T: inputs are padded to whole blocks here and the padded keys masked in the kernels.
The forward saves the log-sum-exp; the backward recomputes P from it (FlashAttention-2).

impl: "mosaic_sm90" (Hopper: TMA + wgmma, warp-specialized, FA3-style), "mosaic_sm100"
(Blackwell: TMA + tcgen05 with scores and accumulator in TMEM, warp-specialized), "triton" (Pallas grid kernel; also
the interpret-mode path on CPU), "cudnn" (jax.nn.dot_product_attention), "xla" (reference.py),
"auto" (by platform, compute capability, dtype and head_dim; each fallback is logged once).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from . import kernel_bwd, kernel_fwd
from .config import FlashConfig, default_config
from .reference import attention_reference, mask_SxT
from ..target import compute_capability, match_varying, target_platform

log = logging.getLogger(__name__)

IMPLS = ("auto", "mosaic_sm90", "mosaic_sm100", "triton", "cudnn", "xla")
PALLAS_IMPLS = ("mosaic_sm90", "mosaic_sm100", "triton")


@functools.cache
def _log_once(msg: str) -> None:
    log.warning(msg)


def _backend(impl: str):
    """(fwd, bwd, (q multiple, kv multiple)) of a Pallas backend, imported on demand."""
    if impl == "triton":
        return kernel_fwd.flash_fwd, kernel_bwd.flash_bwd, _triton_multiples
    if impl == "mosaic_sm90":
        from . import kernel_sm90
        return kernel_sm90.flash_fwd, kernel_sm90.flash_bwd, kernel_sm90.pad_multiples
    if impl == "mosaic_sm100":
        from . import kernel_sm100
        return kernel_sm100.flash_fwd, kernel_sm100.flash_bwd, kernel_sm100.pad_multiples
    raise ValueError(impl)


def _triton_multiples(cfg: FlashConfig):
    return max(cfg.block_q, cfg.block_q_bwd), max(cfg.block_kv, cfg.block_kv_bwd)


def mosaic_unsupported(impl: str, dtype, head_dim: int) -> str | None:
    """Why a Mosaic kernel cannot take these inputs, or None when it can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"{impl} needs bf16/fp16 (wgmma/tcgen05 operands), got {jnp.dtype(dtype).name}"
    if head_dim not in (64, 128, 256):
        return f"{impl} needs head_dim 64, 128 or 256, got {head_dim}"
    return None


def resolve_impl(impl: str, dtype, head_dim: int, *, interpret: bool = False) -> str:
    """The backend 'auto' means here, by platform, compute capability, dtype and head_dim."""
    if impl not in IMPLS:
        raise ValueError(f"unknown flash attention impl {impl!r}; use one of {IMPLS}")
    if impl != "auto":
        return impl
    if interpret:
        return "triton"
    platform = target_platform()
    if platform != "gpu":
        _log_once(f"flash_attention auto: platform {platform!r} has no Pallas GPU kernels; "
                  "using 'xla' (pass interpret=True or impl='triton' to run the kernels)")
        return "xla"
    cc = compute_capability() or (0, 0)
    major = cc[0]
    if major == 9:
        why = mosaic_unsupported("mosaic_sm90", dtype, head_dim)
        if why is None:
            return "mosaic_sm90"
        _log_once(f"flash_attention auto: {why}; using 'triton'")
        return "triton"
    if major == 10:
        why = mosaic_unsupported("mosaic_sm100", dtype, head_dim)
        if why is None:
            return "mosaic_sm100"
        _log_once(f"flash_attention auto: {why}; using 'cudnn'")
        return "cudnn"
    if major > 10:
        _log_once(f"flash_attention auto: compute capability {major}.{cc[1]} has no titanax "
                  "kernel yet; using 'cudnn'")
        return "cudnn"
    _log_once(f"flash_attention auto: compute capability {major}.{cc[1]} (< 9.0) has no Mosaic "
              "kernel; using 'triton'")
    return "triton"


def flash_attention(q, k, v, *, causal: bool = True, softmax_scale: float | None = None,
                    segment_ids=None, impl: str = "auto", config: FlashConfig | None = None,
                    interpret: bool = False):
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
    impl = resolve_impl(impl, q.dtype, D, interpret=interpret)

    if impl == "xla":
        return attention_reference(q, k, v, causal=causal, softmax_scale=scale,
                                   segment_ids=segment_ids)
    if impl == "cudnn":
        mask = None
        if segment_ids is not None:
            mask = mask_SxT(S, T, causal=False, segment_ids=segment_ids)[:, None]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=causal,
            implementation="cudnn" if target_platform() == "gpu" else None)
    if impl != "triton":
        why = mosaic_unsupported(impl, q.dtype, D)
        if why:
            raise ValueError(why)
    cfg = config if config is not None else default_config(impl, D, interpret=interpret)
    if impl != "triton":
        cfg.check_mosaic()
    _, _, multiples = _backend(impl)
    qp, kp, vp, q_seg, kv_seg = _padded(q, k, v, segment_ids, multiples(cfg))
    # Padding and slicing stay outside the custom_vjp: autodiff pads dO with zeros, and
    # padded query rows (dO = 0, delta = 0) contribute nothing to dK/dV.
    out_p = _flash(qp, kp, vp, q_seg, kv_seg, scale, causal, T, impl, cfg, interpret)
    return out_p[:, :S]


def _pad_to(x, axis: int, n: int):
    if x.shape[axis] == n:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, pad)


def _padded(q, k, v, seg, multiples):
    mq, mk = multiples
    Sp = -(-q.shape[1] // mq) * mq
    Tp = -(-k.shape[1] // mk) * mk
    q_seg = kv_seg = None
    if seg is not None:  # pad values are irrelevant: padded keys are masked by kv_len
        q_seg, kv_seg = _pad_to(seg, 1, Sp), _pad_to(seg, 1, Tp)
    return _pad_to(q, 1, Sp), _pad_to(k, 1, Tp), _pad_to(v, 1, Tp), q_seg, kv_seg


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _flash(q, k, v, q_seg, kv_seg, scale, causal, kv_len, impl, cfg, interpret):
    return _flash_fwd(q, k, v, q_seg, kv_seg, scale, causal, kv_len, impl, cfg, interpret)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, scale, causal, kv_len, impl, cfg, interpret):
    fwd, _, _ = _backend(impl)
    out, lse = fwd(q, k, v, q_seg, kv_seg, scale=scale, causal=causal, kv_len=kv_len,
                   config=cfg, interpret=interpret)
    # Inside jax.shard_map, Mosaic GPU kernels return values typed as invariant (plgpu.kernel
    # turns the check off); they vary like q. Cotangents may arrive invariant too.
    out, lse = match_varying(out, q), match_varying(lse, q)
    return out, (q, k, v, q_seg, kv_seg, out, lse)


def _flash_bwd(scale, causal, kv_len, impl, cfg, interpret, res, do):
    q, k, v, q_seg, kv_seg, out, lse = res
    do = match_varying(do, out)
    _, bwd, _ = _backend(impl)
    dq, dk, dv = bwd(q, k, v, out, lse, do, q_seg, kv_seg, scale=scale, causal=causal,
                     kv_len=kv_len, config=cfg, interpret=interpret)
    return match_varying(dq, q), match_varying(dk, k), match_varying(dv, v), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
