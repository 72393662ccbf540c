"""What the model calls: attention and linear, dispatched to XLA or our kernels by config."""

from titanax.ops.attention import attention, attention_mask
from titanax.ops.linear import linear

__all__ = ["attention", "attention_mask", "linear"]
