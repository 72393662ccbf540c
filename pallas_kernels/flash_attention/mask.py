"""THE attention mask: which keys each query may see, and the one dense builder of it.

Every backend gets a `Mask`; the ones that need it dense (the XLA reference, cuDNN with packed
documents or decoding) build it with `Mask.dense`, and our kernels read the same fields as
scalars and tile ranges (tile_ranges.py). Masked scores take MASK_VALUE, a large finite
negative (not -inf), so a fully masked row stays finite, in every backend alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class Mask:
    """Query s (at position s + q_offset) may see key t when: t <= s + q_offset (causal),
    t < kv_valid_len (decoding: cache slots not yet written), and the two share a segment id
    (packed documents). kv_segment_ids: the keys' ids where keys are not the queries'
    positions (context parallelism's blocks); None: segment_ids (S == T)."""

    causal: bool = True
    segment_ids: Any = None  # [B, S] int
    kv_segment_ids: Any = None  # [B, T] int
    q_offset: Any = 0  # int or a traced scalar
    kv_valid_len: Any = None  # int or a traced scalar

    @property
    def kv_segments(self):
        return self.segment_ids if self.kv_segment_ids is None else self.kv_segment_ids

    @property
    def decoding(self) -> bool:
        """Queries offset into a KV cache, or cache slots masked: decoding."""
        return (not (isinstance(self.q_offset, int) and self.q_offset == 0)
                or self.kv_valid_len is not None)

    @property
    def general(self) -> bool:
        """Beyond what the flash kernels take (causal and the queries' own segment ids)."""
        return self.decoding or self.kv_segment_ids is not None

    def dense(self, S: int, T: int):
        """Boolean [B or 1, 1, S, T]: True where query s may attend key t (the 1: heads)."""
        q_pos = jnp.arange(S)[:, None] + self.q_offset
        k_pos = jnp.arange(T)[None, :]
        mask = jnp.ones((S, T), dtype=bool)
        if self.causal:
            mask = mask & (k_pos <= q_pos)
        if self.kv_valid_len is not None:
            mask = mask & (k_pos < self.kv_valid_len)
        mask = mask[None, None]
        if self.segment_ids is not None:
            same = self.segment_ids[:, :, None] == self.kv_segments[:, None, :]
            mask = mask & same[:, None]
        return mask


def attention_mask(q_len: int, kv_len: int, *, causal: bool, q_offset=0, q_segment_ids=None,
                   kv_segment_ids=None, kv_valid_len=None):
    """Mask(...).dense(q_len, kv_len) by keywords: [B or 1, 1, q_len, kv_len]."""
    return Mask(causal, q_segment_ids, kv_segment_ids, q_offset, kv_valid_len).dense(q_len,
                                                                                    kv_len)
