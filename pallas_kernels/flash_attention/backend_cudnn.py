"""The `cudnn` backend: jax.nn.dot_product_attention (cuDNN's fused kernel on GPU, XLA's
elsewhere).

Causal self-attention goes as is_causal: cuDNN's CAUSAL mask type, which never computes the
upper triangle and builds nothing S x S. Packed documents and decoding need the dense mask
(mask.py), and with it every score. (cuDNN's packed-sequence layout, q_offsets/kv_offsets in
jax's private cudnn module, needs a static maximum of documents per row: one too many and
attention silently crosses documents; so packed documents go to our kernels under 'auto'.)
XLA partitions the call itself (its rule wants q, k and v sharded alike); it does not compile
inside jax.shard_map, so it has no blocks for context parallelism.
"""

from __future__ import annotations

import functools
import logging

import jax

from ..target import target_platform
from .mask import Mask

log = logging.getLogger(__name__)


@functools.cache
def _warn_dense_mask() -> None:
    log.warning("attention_impl=cudnn with packed documents (segment ids): cuDNN takes them as "
                "a dense [S, S] mask, so it computes every score (twice the causal work) and "
                "streams an S^2 bias per head; execution.attention_impl=auto runs our kernels, "
                "which skip the tiles of other documents (or set data.document_masking=false)")


def attention(q_BSHK, k_BTNK, v_BTNK, mask: Mask, *, softmax_scale: float, impl=None,
              config=None, interpret=False):
    """out [B, S, H, K]. impl, config, interpret: the table's one signature (unused here)."""
    del impl, config, interpret
    on_gpu = target_platform() == "gpu"
    S, T = q_BSHK.shape[1], k_BTNK.shape[1]
    kw = dict(scale=softmax_scale, implementation="cudnn" if on_gpu else None)
    if not mask.general and mask.segment_ids is None and S == T:
        return jax.nn.dot_product_attention(q_BSHK, k_BTNK, v_BTNK, is_causal=mask.causal,
                                            **kw)
    if mask.segment_ids is not None and on_gpu:
        _warn_dense_mask()
    return jax.nn.dot_product_attention(q_BSHK, k_BTNK, v_BTNK, mask=mask.dense(S, T), **kw)
