"""A kernel against the reference on this device: values and gradients of one case.

What `launch.gpu_check`'s kernels section and titanax's first-contact check before a run's first
step (titanax/train/attention_check.py) both ask of a kernel that may never have run on this
GPU: flash_attention(impl=...) and its VJP against backend_xla.attention_reference run in
float32 on the same inputs. Error per tensor (out, dq, dk, dv) = max|x - ref| / max|ref|,
passing under ATTN_TOL (about flash_attention_test.py's bf16 tolerance); a non-finite output
is an infinite error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .api import flash_attention
from .backend_xla import attention_reference

ATTN_TOL = 2e-2  # bf16, flash_attention_test.py TOL
TENSORS = ("out", "dq", "dk", "dv")


def normal(seed: int, shape, dtype) -> jax.Array:
    """numpy's generator: no compile per shape, as jax.random's would cost in a dry run."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def errors(x, ref) -> dict:
    """max|x - ref| and that over max|ref| (inf for a non-finite x), computed where the arrays
    are (on the device for large tensors)."""
    x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
    if not bool(jnp.all(jnp.isfinite(x))):
        return {"max_abs": float("inf"), "rel": float("inf")}
    max_abs = float(jnp.max(jnp.abs(x - ref)))
    return {"max_abs": max_abs, "rel": max_abs / max(float(jnp.max(jnp.abs(ref))), 1e-30)}


def packed_segments(B: int, S: int) -> jax.Array:
    """Three documents per row, boundaries off the block grid (cuts at S//5 and S//2 + 3, as
    flash_attention_test.py packs them): int32 [B, S]."""
    cuts = np.array([S // 5, S // 2 + 3])
    ids = np.searchsorted(cuts, np.arange(S), side="right")
    return jnp.asarray(np.broadcast_to(ids, (B, S)), jnp.int32)


def vjp_fn(attn):
    """jit of (q, k, v, do) -> (out, dq, dk, dv) for attention function `attn`."""
    def run(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return (out, *vjp(do))
    return jax.jit(run)


def verdict(got, ref) -> dict:
    """Per-tensor relative errors, the largest absolute one, the tolerance and pass, for the
    (out, dq, dk, dv) of a kernel and of the reference."""
    errs = {n: errors(x, r) for n, x, r in zip(TENSORS, got, ref, strict=True)}
    return {**{f"{n}_rel": e["rel"] for n, e in errs.items()},
            "max_abs": max(e["max_abs"] for e in errs.values()),
            "tol": ATTN_TOL, "errors": errs,
            "pass": all(e["rel"] < ATTN_TOL for e in errs.values())}


def check_against_reference(impl: str, *, B: int, S: int, Hq: int, Hkv: int, D: int, dtype,
                            segments: bool, interpret: bool, config=None,
                            seed: int = 0) -> dict:
    """`impl` (causal, GQA Hq / Hkv, with three packed documents when `segments`) against the
    float32 reference on the same `dtype` inputs (normals from seeds seed..seed+3 for q, k, v
    and the output cotangent): verdict()'s dict. config None: the kernel's default config."""
    q, k, v, do = (normal(seed + i, shape, dtype) for i, shape in enumerate(
        [(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D), (B, S, Hq, D)]))
    seg = packed_segments(B, S) if segments else None
    f32 = lambda x: x.astype(jnp.float32)
    ref = jax.block_until_ready(vjp_fn(lambda q, k, v: attention_reference(
        f32(q), f32(k), f32(v), causal=True, segment_ids=seg))(q, k, v, f32(do)))
    fn = vjp_fn(functools.partial(flash_attention, causal=True, segment_ids=seg, impl=impl,
                                  config=config, interpret=interpret))
    return verdict(jax.block_until_ready(fn(q, k, v, do)), ref)
