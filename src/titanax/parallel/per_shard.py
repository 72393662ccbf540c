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
from jax.sharding import PartitionSpec as P

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


def per_shard(fn, q_BSHD, k_BTKD, v_BTKD, segment_ids_BS=None):
    """fn(q, k, v, segment_ids) on each device's (batch, heads) shard; the global result.

    fn must treat batch rows and heads independently and map q head h to kv head
    h // (Hq // Hkv), as attention does. Without a mesh (or a 1-device one) fn runs as is."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return fn(q_BSHD, k_BTKD, v_BTKD, segment_ids_BS)
    free = {a for a in mesh.axis_names if a not in mesh.manual_axes}
    B, _, Hq, _ = q_BSHD.shape
    Hkv = k_BTKD.shape[2]
    G = Hq // Hkv
    q_rule = activation_spec(("batch", "seq", "heads", "head_dim"))
    kv_rule = activation_spec(("batch", "seq", "kv_heads", "head_dim"))
    batch = _split_axes(q_rule[0], B, mesh, free)
    heads = _split_axes(q_rule[2], Hq, mesh, free)
    kv_heads = _split_axes(kv_rule[2], Hkv, mesh, free)
    slice_kv = None  # (kv heads per device, q heads per device) when K/V stay whole
    if heads and kv_heads != heads:
        kv_heads = ()
        hq_local = Hq // math.prod(mesh.shape[a] for a in heads)
        if hq_local % G == 0:
            slice_kv = (hq_local // G, hq_local)
        elif G % hq_local == 0:
            slice_kv = (1, hq_local)
        else:  # q heads of one device span kv heads unevenly: keep the heads whole
            heads = ()
    names = set(batch) | set(heads) | set(kv_heads)
    if not names:
        return fn(q_BSHD, k_BTKD, v_BTKD, segment_ids_BS)

    q_spec = P(_entry(batch), None, _entry(heads), None)
    kv_spec = P(_entry(batch), None, _entry(kv_heads), None)
    seg_spec = P(_entry(batch), None)

    def local(q, k, v, *seg):
        if slice_kv is not None:
            n_kv, hq_local = slice_kv
            start = jax.lax.axis_index(heads) * hq_local // G
            k = jax.lax.dynamic_slice_in_dim(k, start, n_kv, axis=2)
            v = jax.lax.dynamic_slice_in_dim(v, start, n_kv, axis=2)
        return fn(q, k, v, seg[0] if seg else None)

    args = (q_BSHD, k_BTKD, v_BTKD)
    specs = (q_spec, kv_spec, kv_spec)
    if segment_ids_BS is not None:
        args, specs = args + (segment_ids_BS,), specs + (seg_spec,)
    # check_vma=False: Pallas' interpret mode (the CPU path) fails jax's varying-axes check
    # on its internal loops. Nothing here needs it: every axis in `names` is in out_specs, and
    # whole K/V (unsplit over 'tensor') get their cotangent summed over it, which is the
    # transpose of each device using its own slice.
    return jax.shard_map(local, in_specs=specs, out_specs=q_spec, axis_names=names,
                         check_vma=False)(*args)
