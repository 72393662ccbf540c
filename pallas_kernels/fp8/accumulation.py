"""Which FP8 GEMMs may accumulate fast: THE one place that decides it (Transformer Engine's
rule), and how XLA is told.

Hopper's FP8 tensor-core MMA adds into an accumulator of about 14 mantissa bits unless the
GEMM promotes partial sums to float32 (reference.emulate_wgmma_accumulation models it).
cuBLASLt calls the unpromoted mode "fast accumulation" (CUBLASLT_MATMUL_DESC_FAST_ACCUM).
Transformer Engine runs the forward GEMM with it and dgrad and wgrad without it (its "split
accumulator"), because the gradients sum over long K (wgrad over all tokens of the step).

How XLA in jax 0.11.2 decides, for an FP8 dot_general (read from XLA's source and checked in
deviceless H100 compiles, pallas_kernels/fp8/test_accumulation.py):
- cuBLASLt (`__cublas$lt$matmul$f8`): without a dot algorithm, fast accumulation is on
  exactly when both operand precisions are DEFAULT; HIGHEST turns it off
  (stream_executor/cuda/cuda_blas_lt.cc IsFastAccumEnabled; openxla/xla#6168, #6599; flax's
  fp8_ops asks HIGHEST for its backward). The precision is in the custom call's
  backend_config ("operand_precision").
- Triton: XLA's emitter gives every FP8 dot maxNumImpreciseAcc = INT_MAX (never promoted)
  whatever the precision (checked in the Triton IR of a deviceless compile). XLA fuses an
  FP8 dot with its scale epilogue into a Triton GEMM and, on a GPU, the autotuner may keep
  Triton; so the precision holds only with Triton GEMMs off: XLA_GPU_FLAGS in backends.py,
  part of titanax's GPU flags (titanax/xla_flags.py).
- The dot algorithms ANY_F8_ANY_F8_F32(_FAST_ACCUM) would state it outright (and Triton
  declines them), but jax 0.11.2's Shardy partitioner drops every dot algorithm on a mesh of
  more than one device (its HLO round trip, pass "shardy-xla"), which is every FSDP run;
  operand precision survives it.
Off a GPU the dot carries no precision: XLA:CPU upcasts FP8 exactly and accumulates in
float32 anyway, and CPU programs stay as they were.
"""

from __future__ import annotations

import jax

# TE's GEMM names: y = x w (forward), dx = dy w^T (data gradient), dw = x^T dy (weight gradient).
GEMMS = ("fprop", "dgrad", "wgrad")
FAST_ACCUMULATION = {"fprop": True, "dgrad": False, "wgrad": False}
assert set(FAST_ACCUMULATION) == set(GEMMS)


def xla_dot_precision(gemm: str, platform: str):
    """precision= for the FP8 dot_general of GEMM `gemm` compiled for `platform`: DEFAULT
    (cuBLASLt fast accumulation) or HIGHEST (none) on a GPU, as FAST_ACCUMULATION says; None
    elsewhere."""
    if gemm not in FAST_ACCUMULATION:
        raise ValueError(f"unknown FP8 GEMM {gemm!r}; use one of {list(GEMMS)}")
    if platform != "gpu":
        return None
    return jax.lax.Precision.DEFAULT if FAST_ACCUMULATION[gemm] else jax.lax.Precision.HIGHEST
