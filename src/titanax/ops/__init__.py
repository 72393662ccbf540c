"""What the model calls: attention and linear, dispatched to XLA or our kernels by config."""

from titanax.ops.attention import attention, attention_mask
from titanax.ops.cross_entropy import IGNORE_INDEX, loss_tokens
from titanax.ops.linear import (
                                 Fp8Meta,
                                 count_nonfinite_amax,
                                 fp8_meta_dict,
                                 linear,
                                 make_fp8_meta,
                                 max_histories,
)

__all__ = ["attention", "attention_mask", "linear", "Fp8Meta", "make_fp8_meta", "fp8_meta_dict",
           "max_histories", "count_nonfinite_amax", "IGNORE_INDEX", "loss_tokens"]
