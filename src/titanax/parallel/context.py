"""Context parallelism: each sequence split over the 'seq' rule's mesh axes (mesh.context
devices), attention exchanging keys and values between them.

Causal load balance (TorchTitan's and Megatron's layout): the sequence is cut into 2C chunks
and device r holds chunks r and 2C-1-r, so every device has as many visible (query, key)
pairs. The model reorders its inputs once (`balanced`) and its logits back (`natural`); the
loss is a sum over tokens and needs no reordering. Causality then follows from the chunk
indices alone, and every attention block is a plain kernel call:
  - a device's own keys: causal over its two chunks (chunk r's positions all precede chunk
    2C-1-r's, so the local causal mask is the global one);
  - keys from a device s < r (chunks s and 2C-1-s): every local query sees chunk s, none sees
    chunk 2C-1-s;
  - keys from s > r: only the local chunk 2C-1-r sees them, all of both chunks.
Each block returns its output and log-sum-exp; blocks merge exactly by their log-sum-exps.
The backward recomputes each block's probabilities against the merged log-sum-exp
(FlashAttention-2), so the blocks' gradients add up to the exact gradient.

Two ways to reach the other devices' keys (execution.context_strategy):
  - 'ring': K/V pass around the ring with ppermute, the transfer of the next block issued
    before the attention of the current one so XLA overlaps them; the backward passes K/V
    and their float32 gradient accumulators the same way, the gradients arriving home after
    one more step;
  - 'all_gather': K/V gathered once, blocks sliced from the gathered copy; the backward
    gathers again and reduce-scatters the gradients. One collective instead of C-1 dependent
    ones: better for short local sequences and GQA's small K/V.

The functions here run inside jax.shard_map bodies over the context axes (parallel/per_shard.py
builds the shard_map, as for the per-shard attention kernels); block_fwd / block_bwd are
pallas_kernels.flash_attention.flash_block_fwd / _bwd (or the jnp reference pair) with the
kernel choice bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from titanax.config import CONTEXT_STRATEGIES

from .rules import batch_shards


def context_shards(seq_len: int) -> int:
    """Devices a sequence of seq_len tokens is split over by context parallelism on the mesh
    in context: the 'seq' rule's degree when seq_len cuts into two chunks per device, else 1
    (no mesh, or a length that cannot be balanced: it then stays whole for attention). The
    model's reordering and ops.attention ask this same question."""
    C = batch_shards("seq")
    return C if C > 1 and seq_len % (2 * C) == 0 else 1


def balanced(x, C: int, axis: int = 1):
    """Natural sequence order -> the load-balanced one: chunks [0, 2C-1, 1, 2C-2, ...], so an
    even split over C devices gives device r chunks r and 2C-1-r. Reshapes, a flip and a stack:
    no gather, and local to each device while the sequence is not yet split."""
    if C == 1:
        return x
    shape, S = x.shape, x.shape[axis]
    x = x.reshape(*shape[:axis], 2, C, S // (2 * C), *shape[axis + 1:])
    first = jnp.take(x, 0, axis=axis)
    second = jnp.flip(jnp.take(x, 1, axis=axis), axis=axis)
    return jnp.stack([first, second], axis=axis + 1).reshape(shape)


def natural(x, C: int, axis: int = 1):
    """The inverse of `balanced`."""
    if C == 1:
        return x
    shape, S = x.shape, x.shape[axis]
    x = x.reshape(*shape[:axis], C, 2, S // (2 * C), *shape[axis + 1:])
    first = jnp.take(x, 0, axis=axis + 1)
    second = jnp.flip(jnp.take(x, 1, axis=axis + 1), axis=axis)
    return jnp.stack([first, second], axis=axis).reshape(shape)


def _half(x, which: int, axis: int = 1):
    if x is None:
        return None
    h = x.shape[axis] // 2
    return jax.lax.slice_in_dim(x, which * h, (which + 1) * h, axis=axis)


def _pad_half(x, which: int, fill, axis: int = 1):
    """x (one half along axis) placed in a whole of twice its length, `fill` elsewhere."""
    other = jnp.full_like(x, fill)
    return jnp.concatenate([x, other] if which == 0 else [other, x], axis=axis)


def _merge(out, lse, o, l):
    """Two partial attentions of the same queries -> their exact combination."""
    new = jnp.logaddexp(lse, l)
    w_old = jnp.exp(lse - new).transpose(0, 2, 1)[..., None]
    w_new = jnp.exp(l - new).transpose(0, 2, 1)[..., None]
    return out * w_old + o.astype(jnp.float32) * w_new, new


def _remote_fwd(block_fwd, q, k, v, seg, kseg, earlier):
    """A remote device's K/V block against the local queries: (out float32, lse) over all
    local rows (rows that see nothing of it get lse -inf)."""
    def from_earlier():  # every local query sees the block's first chunk, none its second
        o, l = block_fwd(q, _half(k, 0), _half(v, 0), seg, _half(kseg, 0), causal=False)
        return o.astype(jnp.float32), l

    def from_later():  # only the local second chunk sees it, all of it
        o, l = block_fwd(_half(q, 1), k, v, _half(seg, 1), kseg, causal=False)
        return (_pad_half(o.astype(jnp.float32), 1, 0.0),
                _pad_half(l, 1, -jnp.inf, axis=2))

    return jax.lax.cond(earlier, from_earlier, from_later)


def _remote_bwd(block_bwd, q, k, v, seg, kseg, out, lse, do, earlier):
    """(dq, dk, dv) float32 of `_remote_fwd`'s block, zero where it contributed nothing."""
    f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)

    def from_earlier():
        dq, dk, dv = f32(*block_bwd(q, _half(k, 0), _half(v, 0), seg, _half(kseg, 0), out,
                                    lse, do, causal=False))
        return dq, _pad_half(dk, 0, 0.0), _pad_half(dv, 0, 0.0)

    def from_later():
        dq, dk, dv = f32(*block_bwd(_half(q, 1), k, v, _half(seg, 1), kseg, _half(out, 1),
                                    _half(lse, 1, axis=2), _half(do, 1), causal=False))
        return _pad_half(dq, 1, 0.0), dk, dv

    return jax.lax.cond(earlier, from_earlier, from_later)


class ContextAttention:
    """The forward and backward bodies of context-parallel attention for one shard_map over
    `axes` (C devices): fwd(q, k, v, seg) -> (out, lse [B, Hq, S] natural log) and
    bwd(q, k, v, seg, out, lse, do) -> (dq, dk, dv), on each device's balanced part."""

    def __init__(self, block_fwd, block_bwd, axes: tuple[str, ...], C: int, strategy: str):
        if strategy not in CONTEXT_STRATEGIES:
            raise ValueError(f"unknown context strategy {strategy!r}; use one of "
                             f"{CONTEXT_STRATEGIES}")
        self.block_fwd, self.block_bwd = block_fwd, block_bwd
        self.axes, self.C, self.strategy = axes, C, strategy

    def _shift(self, x):
        """Each device's x to the next device of the ring (None stays None)."""
        if x is None:
            return None
        return jax.lax.ppermute(x, self.axes, [(i, (i + 1) % self.C) for i in range(self.C)])

    def _sources(self, k, v, seg):
        """[(step i, K, V, segment ids of device r - i)] for i = 1..C-1. Called before the
        own block's attention, so the first transfer (the ring's, or the gather) is issued
        ahead of it; each ring step issues the next transfer before its own attention."""
        if self.strategy == "all_gather":
            gather = lambda x: None if x is None else jax.lax.all_gather(
                x, self.axes, axis=1, tiled=True)
            return self._gathered_steps(k.shape[1], gather(k), gather(v), gather(seg))
        return self._ring_steps(self._shift_all((k, v, seg)))

    def _shift_all(self, xs):
        return tuple(map(self._shift, xs))

    def _ring_steps(self, incoming):
        for i in range(1, self.C):
            block = incoming
            if i < self.C - 1:
                incoming = self._shift_all(block)
            yield (i, *block)

    def _gathered_steps(self, L, kg, vg, sg):
        r = jax.lax.axis_index(self.axes)
        for i in range(1, self.C):
            start = ((r - i) % self.C) * L
            take = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(
                x, start, L, axis=1)
            yield i, take(kg), take(vg), take(sg)

    def fwd(self, q, k, v, seg):
        sources = self._sources(k, v, seg)
        out, lse = self.block_fwd(q, k, v, seg, seg, causal=True)
        out = out.astype(jnp.float32)
        r = jax.lax.axis_index(self.axes)
        for i, k_s, v_s, seg_s in sources:
            o, l = _remote_fwd(self.block_fwd, q, k_s, v_s, seg, seg_s, i <= r)
            out, lse = _merge(out, lse, o, l)
        return out.astype(q.dtype), lse

    def bwd(self, q, k, v, seg, out, lse, do):
        f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)
        sources = self._sources(k, v, seg)
        dq, dk, dv = f32(*self.block_bwd(q, k, v, seg, seg, out, lse, do, causal=True))
        r = jax.lax.axis_index(self.axes)
        if self.strategy == "all_gather":
            dq, dk, dv = self._bwd_gathered(sources, q, k, v, seg, out, lse, do, dq, dk, dv, r)
        else:
            dq, dk, dv = self._bwd_ring(sources, q, seg, out, lse, do, dq, dk, dv, r)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    def _bwd_ring(self, sources, q, seg, out, lse, do, dq, dk, dv, r):
        # The gradient accumulators travel with their K/V block; after C-1 steps the block
        # of device r+1 is here, and one more step takes its gradients home.
        grads = (dk, dv)
        for i, k_s, v_s, seg_s in sources:
            grads = self._shift_all(grads)
            dq_i, dk_i, dv_i = _remote_bwd(self.block_bwd, q, k_s, v_s, seg, seg_s, out, lse,
                                           do, i <= r)
            dq, grads = dq + dq_i, (grads[0] + dk_i, grads[1] + dv_i)
        dk, dv = self._shift_all(grads)
        return dq, dk, dv

    def _bwd_gathered(self, sources, q, k, v, seg, out, lse, do, dq, dk, dv, r):
        # Every block's gradient lands in a whole-sequence float32 buffer at its device's
        # place; one reduce-scatter sums them over the devices and hands each its own part.
        L = k.shape[1]
        whole = lambda x: jnp.zeros((x.shape[0], self.C * L, *x.shape[2:]), jnp.float32)
        add_at = lambda buf, part, s: jax.lax.dynamic_update_slice_in_dim(
            buf, jax.lax.dynamic_slice_in_dim(buf, s * L, L, axis=1) + part, s * L, axis=1)
        dk_all, dv_all = add_at(whole(k), dk, r), add_at(whole(v), dv, r)
        for i, k_s, v_s, seg_s in sources:
            dq_i, dk_i, dv_i = _remote_bwd(self.block_bwd, q, k_s, v_s, seg, seg_s, out, lse,
                                           do, i <= r)
            s = (r - i) % self.C
            dq, dk_all, dv_all = dq + dq_i, add_at(dk_all, dk_i, s), add_at(dv_all, dv_i, s)
        scatter = lambda x: jax.lax.psum_scatter(x, self.axes, scatter_dimension=1, tiled=True)
        return dq, scatter(dk_all), scatter(dv_all)
