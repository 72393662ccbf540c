"""A Hopper wgmma chain accumulating onto a float32 value, shared by the Mosaic GPU kernels
(flash attention sm90, FP8 matmul sm90)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def wgmma_into(acc, issue, interpret: bool):
    """acc + (the wgmma chain `issue(acc_ref)` issues), waited for. On the GPU the wgmma
    accumulates into acc's registers (pl.run_state); the Mosaic GPU interpreter has no rule for
    run_state (jax 0.11.2), so there a zero accumulator is used and added: the same arithmetic
    up to float32 rounding order."""
    if not interpret:
        return pl.run_state(issue)(plgpu.ACC.init(acc))

    def scoped(acc_ref):
        issue(acc_ref)
        return acc_ref[...]
    return acc + pl.run_scoped(scoped, plgpu.ACC(acc.shape, jnp.float32))
