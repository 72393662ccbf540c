"""Attention as the model calls it: q [B, S, H, K], k/v [B, T, N, K] -> [B, S, H, K].

`impl` (execution.attention_impl) names an entry of pallas_kernels/flash_attention/backends.py's
table or 'auto'; pallas_kernels.flash_attention runs it (the backends, `auto` and the
mask are there). What is left here is titanax's side: where the call runs on the mesh.
- Context parallelism (the sequence split over the 'seq' rule's axes): blocks of the chosen
  backend (api.flash_block_fwd / _bwd) merged by their log-sum-exp (parallel/context.py).
- Our Pallas kernels run per device shard (parallel/per_shard.py): XLA cannot partition a
  Pallas call. On a CPU they run in interpret mode (slow, meant for tests), as plain HLO that
  XLA partitions itself.
- Backends that XLA partitions itself get q, k and v sharded alike when their table entry
  says its rule needs that (cuDNN's).
Decoding with a KV cache (q_offset / kv_valid_len) goes to a backend that takes any mask
(backends.GENERAL for our kernels, which are for training and prefill).
"""

from __future__ import annotations

import functools
import math

import jax

from pallas_kernels.flash_attention.api import (
    attention_backend,
    flash_attention,
    flash_attention_bwd,
    flash_attention_fwd,
    flash_block_bwd,
    flash_block_fwd,
)
from pallas_kernels.flash_attention.mask import Mask, attention_mask
from pallas_kernels.target import target_platform
from titanax.parallel.context import ContextAttention, context_shards
from titanax.parallel.per_shard import aligned, per_shard_attention, seq_axes

__all__ = ["attention", "attention_mask", "context_parallel_attention"]


def attention(q_BSHK, k_BTNK, v_BTNK, *, impl: str = "xla", causal: bool = True,
              segment_ids=None, kv_segment_ids=None, q_offset=0, kv_valid_len=None,
              softmax_scale: float | None = None, context_strategy: str = "ring"):
    """context_strategy: how K/V reach the other devices when the mesh splits the sequence
    ('seq' on 'context'; parallel/context.py); the inputs are then in its balanced order."""
    S, T = q_BSHK.shape[1], k_BTNK.shape[1]
    mask = Mask(causal, segment_ids, kv_segment_ids, q_offset, kv_valid_len)
    if not mask.general and S == T and context_shards(S) > 1:
        return context_parallel_attention(q_BSHK, k_BTNK, v_BTNK, impl=impl, causal=causal,
                                          segment_ids=segment_ids,
                                          softmax_scale=softmax_scale,
                                          strategy=context_strategy)
    interpret = target_platform() == "cpu" and impl != "auto"
    b = attention_backend(impl, q_BSHK.dtype, q_BSHK.shape[-1], mask, interpret=interpret,
                          seq_len=S)
    kw = dict(causal=causal, softmax_scale=softmax_scale, impl=b.name, interpret=interpret)
    if b.is_kernel and not interpret:  # XLA cannot partition a Pallas call: per shard
        fwd = functools.partial(flash_attention_fwd, **kw)
        bwd = functools.partial(flash_attention_bwd, **kw)
        # With segment ids the kernels' loop bounds are scalars read from their tile ranges,
        # which vary over the batch axes; jax's varying-axes check rejects such a bound inside
        # a Mosaic kernel's loops, so it is off for that call (the results are typed like
        # their inputs again, as for context parallelism).
        return per_shard_attention(fwd, bwd, q_BSHK, k_BTNK, v_BTNK, segment_ids,
                                   check_vma=segment_ids is None)
    if b.same_sharding and not mask.decoding:
        q_BSHK, k_BTNK, v_BTNK = aligned(q_BSHK, k_BTNK, v_BTNK)
    return flash_attention(q_BSHK, k_BTNK, v_BTNK, segment_ids=segment_ids,
                           kv_segment_ids=kv_segment_ids, q_offset=q_offset,
                           kv_valid_len=kv_valid_len, **kw)


def context_parallel_attention(q_BSHK, k_BTNK, v_BTNK, *, impl: str, causal: bool,
                               segment_ids, softmax_scale, strategy: str):
    """Causal self-attention of sequences split over the 'seq' rule's mesh axes, in
    parallel/context.py's balanced order: blocks of the backend (our kernels, or the jnp
    reference for impl='xla') merged by their log-sum-exp, K/V exchanged by ring or
    all-gather."""
    if not causal:
        raise ValueError("context parallelism splits causal self-attention (its load balance "
                         "and block masks assume it); use mesh.context=1 for this call")
    if q_BSHK.shape[2] % k_BTNK.shape[2]:
        raise ValueError(f"query heads {q_BSHK.shape[2]} must be a multiple of kv heads "
                         f"{k_BTNK.shape[2]}")
    axes = seq_axes(q_BSHK.shape[1])
    C = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes)
    if C != context_shards(q_BSHK.shape[1]):
        raise ValueError(f"the sequence of {q_BSHK.shape[1]} splits over {axes} ({C} ways), "
                         f"which is not the context degree {context_shards(q_BSHK.shape[1])}")
    interpret = target_platform() == "cpu" and impl != "auto"
    b = attention_backend(impl, q_BSHK.dtype, q_BSHK.shape[-1], Mask(causal, segment_ids),
                          interpret=interpret, manual=True)
    if b.block_fwd is None:
        raise ValueError(f"{b.name} attention cannot run context parallelism (it does not "
                         "compile inside jax.shard_map); use auto, xla or one of our kernels")
    kw = dict(softmax_scale=softmax_scale, impl=b.name, interpret=interpret)
    ctx = ContextAttention(functools.partial(flash_block_fwd, **kw),
                           functools.partial(flash_block_bwd, **kw), axes, C, strategy)
    # check_vma=False: Pallas' interpreter fails the varying-axes check inside shard_map, and
    # with it on, a remat around the call (a pipeline tick) splits the blocks' constant work
    # out of the shard_map with specs on the manual 'pipeline' axis, which does not compile.
    # per_shard_attention types the results like their inputs again.
    return per_shard_attention(ctx.fwd, ctx.bwd, q_BSHK, k_BTNK, v_BTNK, segment_ids,
                               split_seq=True, check_vma=False)
