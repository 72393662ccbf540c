"""Attention kernels that XLA cannot partition, run on each device's shard of their inputs.

A Pallas (Mosaic GPU or Triton) kernel is one opaque custom call to XLA's SPMD partitioner: with
batch-sharded (data, FSDP) or head-sharded (tensor) inputs it gathers them, and every device
computes the whole global batch and every head (a deviceless H100 compile on a data 2 x
tensor 4 mesh ran the kernel on bf16[8,2048,32,128], the global q, on each device). So the
flash kernels run under jax.shard_map, split along batch and heads as the activation rules of
rules.py place them. Attention is independent per (batch row, head): no communication.

Fallbacks, each correct, never an error: a dimension the mesh axes do not divide is split over
the longest prefix of its axes that does (or not at all), and is gathered for the kernel; when
q heads split over 'tensor' but kv heads do not (8 kv heads, tensor 16), K and V stay whole and
each device slices the kv heads its q heads use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.target import match_varying

from .rules import activation_spec


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _split_axes(entry, dim: int, mesh, free) -> tuple[str, ...]:
    """The longest prefix of the rule's mesh axes (free here, size > 1) whose product divides
    dim."""
    axes = tuple(a for a in _axes(entry) if a in free and mesh.shape[a] > 1)
    while axes and dim % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    return axes


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def per_shard_attention(fwd, bwd, q_BSHK, k_BTNK, v_BTNK, segment_ids_BS=None, *,
                        split_seq: bool = False, check_vma: bool = True):
    """Differentiable attention whose halves run on each device's (batch, heads) shard:
    fwd(q, k, v, seg) -> (out, lse [B, Hq, ...]) and bwd(q, k, v, seg, out, lse, do) ->
    (dq, dk, dv), as pallas_kernels.flash_attention_fwd/_bwd. Each half is its own shard_map
    whose inputs are plain arrays: JAX cannot yet differentiate a shard_map nested in the
    pipeline's (its residuals get specs on the already-manual 'pipeline' axis).

    fwd and bwd must treat batch rows and heads independently and map q head h to kv head
    h // (Hq // Hkv). Without a mesh (or with nothing to split) they run unsharded.
    split_seq: the sequence is split too, over the 'seq' rule's axes (context parallelism):
    fwd and bwd then see each device's part of it and exchange K/V themselves
    (parallel/context.py). check_vma=False turns jax's varying-axes check off inside the
    shard_maps (ops.attention says why context parallelism needs that)."""
    fwd_m, bwd_m = fwd, bwd
    layout = _layout(q_BSHK, k_BTNK, split_seq)
    if layout is not None:
        fwd_m, bwd_m = _sharded_halves(fwd, bwd, layout, segment_ids_BS is not None, check_vma)

    @jax.custom_vjp
    def attention(q, k, v, seg):
        return fwd_m(q, k, v, seg)[0]

    def attention_fwd(q, k, v, seg):
        out, lse = fwd_m(q, k, v, seg)
        return out, (q, k, v, seg, out, lse)

    def attention_bwd(res, do):
        q, k, v, seg, out, lse = res
        # Inside a pipeline stage a cotangent may arrive invariant over 'pipeline' and the
        # gradients with it: they must vary like the primals they belong to.
        dq, dk, dv = bwd_m(q, k, v, seg, out, lse, do)
        return dq, dk, dv, None

    attention.defvjp(attention_fwd, attention_bwd)
    return attention(q_BSHK, k_BTNK, v_BTNK, segment_ids_BS)


def aligned(q_BSHK, k_BTNK, v_BTNK):
    """q, k, v constrained to the same batch and head sharding per_shard_attention would use:
    cuDNN's partitioning rule refuses q, k and v sharded differently, which XLA's propagation
    produces when a microbatch or the kv heads do not divide the mesh evenly."""
    layout = _layout(q_BSHK, k_BTNK)
    if layout is None:
        return q_BSHK, k_BTNK, v_BTNK
    constrain = jax.lax.with_sharding_constraint
    return (constrain(q_BSHK, layout["q"]), constrain(k_BTNK, layout["kv"]),
            constrain(v_BTNK, layout["kv"]))


def seq_axes(seq_len: int) -> tuple[str, ...]:
    """The mesh axes (size > 1, not manual here) the 'seq' rule splits a sequence over."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return ()
    free = {a for a in mesh.axis_names if a not in mesh.manual_axes}
    return _split_axes(activation_spec(("seq",))[0], seq_len, mesh, free)


def _layout(q_BSHK, k_BTNK, split_seq: bool = False):
    """(mesh axes, q/kv/seg/lse specs, heads axes, K/V slicing) or None when nothing splits."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return None
    free = {a for a in mesh.axis_names if a not in mesh.manual_axes}
    B, _, Hq, _ = q_BSHK.shape
    Hkv = k_BTNK.shape[2]
    G = Hq // Hkv
    q_rule = activation_spec(("batch", "seq", "heads", "head_dim"))
    kv_rule = activation_spec(("batch", "seq", "kv_heads", "head_dim"))
    batch = _split_axes(q_rule[0], B, mesh, free)
    heads = _split_axes(q_rule[2], Hq, mesh, free)
    kv_heads = _split_axes(kv_rule[2], Hkv, mesh, free)
    slice_kv = None  # (kv heads per device, q heads per device, G) when K/V stay whole
    if heads and kv_heads != heads:
        kv_heads = ()
        hq_local = Hq // math.prod(mesh.shape[a] for a in heads)
        if hq_local % G == 0:
            slice_kv = (hq_local // G, hq_local, G)
        elif G % hq_local == 0:
            slice_kv = (1, hq_local, G)
        else:  # q heads of one device span kv heads unevenly: keep the heads whole
            heads = ()
    seq = seq_axes(q_BSHK.shape[1]) if split_seq else ()
    names = set(batch) | set(heads) | set(kv_heads) | set(seq)
    if not names:
        return None
    b, h, s = _entry(batch), _entry(heads), _entry(seq)
    return dict(names=names, q=P(b, s, h, None), kv=P(b, s, _entry(kv_heads), None),
                seg=P(b, s), lse=P(b, h, s), heads=heads, slice_kv=slice_kv)


def _sharded_halves(fwd, bwd, layout, has_seg, check_vma=True):
    heads, slice_kv = layout["heads"], layout["slice_kv"]
    q_s, kv_s, seg_s, lse_s = layout["q"], layout["kv"], layout["seg"], layout["lse"]
    seg_specs = (seg_s,) if has_seg else ()

    def my_kv_heads():
        """(first kv head, count) that this device's q heads use, when K/V stay whole."""
        n_kv, hq_local, G = slice_kv
        return jax.lax.axis_index(heads) * hq_local // G, n_kv

    def local_fwd(q, k, v, *seg):
        if slice_kv is not None:
            start, n = my_kv_heads()
            k = jax.lax.dynamic_slice_in_dim(k, start, n, axis=2)
            v = jax.lax.dynamic_slice_in_dim(v, start, n, axis=2)
        return fwd(q, k, v, seg[0] if seg else None)

    def local_bwd(q, k, v, *rest):
        seg = rest[0] if has_seg else None
        out, lse, do = rest[-3:]
        if slice_kv is None:
            return bwd(q, k, v, seg, out, lse, do)
        start, n = my_kv_heads()
        k_l = jax.lax.dynamic_slice_in_dim(k, start, n, axis=2)
        v_l = jax.lax.dynamic_slice_in_dim(v, start, n, axis=2)
        dq, dk_l, dv_l = bwd(q, k_l, v_l, seg, out, lse, do)
        # Whole K/V: each device's gradient lands on its kv heads; the sum over the
        # devices sharing 'heads' is the gradient.
        def whole(full, part):  # summed in fp32: up to 'tensor'-many bf16 terms
            grad = jax.lax.dynamic_update_slice_in_dim(
                jnp.zeros(full.shape, jnp.float32), part.astype(jnp.float32), start, axis=2)
            return jax.lax.psum(grad, heads).astype(full.dtype)
        return dq, whole(k, dk_l), whole(v, dv_l)

    names = layout["names"]
    fwd_sm = jax.shard_map(local_fwd, in_specs=(q_s, kv_s, kv_s, *seg_specs),
                           out_specs=(q_s, lse_s), axis_names=names, check_vma=check_vma)
    bwd_sm = jax.shard_map(local_bwd, in_specs=(q_s, kv_s, kv_s, *seg_specs, q_s, lse_s, q_s),
                           out_specs=(q_s, kv_s, kv_s), axis_names=names, check_vma=check_vma)

    # Without the varying-axes check the results come back typed invariant over the axes
    # already manual outside (a pipeline stage's), though they differ per stage: typed as
    # their inputs' again, or a later transpose would sum them over the stages.
    def fwd_m(q, k, v, seg):
        out, lse = fwd_sm(q, k, v, *((seg,) if has_seg else ()))
        return match_varying(out, q), match_varying(lse, q)

    def bwd_m(q, k, v, seg, out, lse, do):
        dq, dk, dv = bwd_sm(q, k, v, *((seg,) if has_seg else ()), out, lse, do)
        return match_varying(dq, q), match_varying(dk, k), match_varying(dv, v)
    return fwd_m, bwd_m
