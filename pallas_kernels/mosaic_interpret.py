"""The one switch between compiling a Mosaic GPU kernel and running it in the Mosaic GPU
interpreter on CPU (SMEM, mbarriers, TMA, wgmma and tcgen05 modelled), shared by every op
folder whose kernels take `interpret: bool` (flash_attention, grouped_matmul)."""

from __future__ import annotations

import contextlib

from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_ctx(interpret: bool):
    """A context under which the kernels built inside run in the interpreter (interpret), or
    compile as usual."""
    return plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()) if interpret \
        else contextlib.nullcontext()
