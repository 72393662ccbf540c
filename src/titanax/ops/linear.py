"""Matmuls as the model calls them: parameters stay in param_dtype, compute runs in dtype.

`precision` comes from model.matmul_precision: 'default' multiplies in the compute dtype with
float32 accumulation where the backend does so; 'highest' asks for full-precision passes. FP8
recipes plug in here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_PRECISION = {"default": None, "highest": jax.lax.Precision.HIGHEST}


def linear(x, w, spec: str, *, precision: str = "default", dtype=jnp.bfloat16):
    """einsum(spec, x, w) with both operands cast to the compute dtype."""
    if precision not in _PRECISION:
        raise ValueError(f"unknown matmul precision {precision!r}; use one of {list(_PRECISION)}")
    return jnp.einsum(spec, x.astype(dtype), w.astype(dtype), precision=_PRECISION[precision])
