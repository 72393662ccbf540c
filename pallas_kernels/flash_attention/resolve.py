"""What flash_attention(impl='auto') means here, read from the backend table (backends.py).

On GPU 'auto' chooses by the work the call will do until a benchmark recorded in docs/ says
which is faster (measured.py):
- causal attention without documents: cuDNN's fused kernel (is_causal: CAUSAL mask type) and
  ours both compute the causal half of the scores, so the tuned vendor path wins the tie;
- packed documents (segment ids): cuDNN can take them only as a dense [S, T] mask, computing
  every score (twice the causal work) and streaming an S^2 bias per head, while ours skip every
  key tile before the query tile's document start (tile_ranges.py): ours;
- shard_map bodies (pipeline stages, context parallelism): cuDNN's partitioning rule does not
  compile there: ours.
A recorded win makes ours the default for its GPU generation outright. Off a GPU: the XLA
reference; with interpret=True: the grid kernel in interpret mode. The choice and its reason
are logged once.

A kernel refused in this process (refuse(): it failed the run's first-contact check against
the reference on this GPU, titanax/train/attention_check.py) is never what `auto` picks: the
call goes to cuDNN where cuDNN can take it (packed documents as its dense mask, whose cost
backend_cudnn warns of once), else, inside jax.shard_map, to the XLA reference. Explicit
impl names are never changed. A kernel that pallas_kernels/measured.py FAILED records failing
on this GPU generation (with or without packed documents, as the call has them) is refused the
same way, in every process.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from .. import measured
from ..target import compute_capability, target_platform
from .backends import (
    CPU_DEFAULT,
    GENERAL,
    GPU_FALLBACK,
    GPU_VENDOR,
    INTERPRET_DEFAULT,
    KERNEL_IMPLS,
    backend,
    generation_kernels,
)
from .tile_ranges import causal_tiles

log = logging.getLogger(__name__)


REFERENCE = "xla"  # where a refused kernel's calls go when cuDNN cannot take them
_CUDNN_DTYPES = ("bfloat16", "float16")
_REFUSED: dict[str, str] = {}  # impl -> why, for this process


@functools.cache
def _log_once(msg: str) -> None:
    log.warning(msg)


def _quiet(msg: str) -> None:
    del msg


def refuse(impl: str, why: str) -> None:
    """From now on, in this process, `auto` never picks kernel `impl` (why: e.g. the error
    of its check on this GPU). Call it before the programs that use attention are traced."""
    _REFUSED[backend(impl).name] = why


def refused() -> dict[str, str]:
    """The kernels refused in this process: {impl: why}."""
    return dict(_REFUSED)


def clear_refusals() -> None:
    """Forgets every refusal (tests; a process that starts over)."""
    _REFUSED.clear()


def unsupported(impl: str, dtype, head_dim: int) -> str | None:
    """Why backend `impl` cannot take inputs of this dtype and head_dim, or None when it can."""
    return backend(impl).unsupported(jnp.dtype(dtype).name, head_dim)


def in_manual_axes() -> bool:
    """Tracing inside jax.shard_map over some mesh axis (a pipeline stage, per-shard code)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh is not None and not mesh.empty and bool(mesh.manual_axes)


def our_kernel(cc, dtype, head_dim: int) -> str | None:
    """Our kernel for this GPU generation when it takes these inputs, else None."""
    fits = [b.name for b in generation_kernels(cc[0]) if not unsupported(b.name, dtype, head_dim)]
    return fits[0] if fits else None


def resolve_impl(impl: str, dtype, head_dim: int, *, interpret: bool = False,
                 segment_ids: bool = False, manual: bool | None = None,
                 seq_len: int | None = None, general: bool = False,
                 plan: bool = False) -> str:
    """The backend 'auto' means here, by platform, compute capability, dtype, head_dim, whether
    there are segment ids, and whether we trace inside jax.shard_map (`manual`; None: look).
    seq_len (optional) puts numbers on the logged reason. general: the mask is more than causal
    and segment ids (decoding with a KV cache): backends.GENERAL. plan=True: what auto picks
    for these inputs before any check refused a kernel (refusals ignored), logging nothing
    (the call that runs logs its choice). Any other name is checked against the table and
    returned as it is."""
    if impl != "auto":
        return backend(impl).name  # unknown names: one error listing the table
    if general:
        return GENERAL
    if interpret:
        return INTERPRET_DEFAULT
    say = _quiet if plan else _log_once
    platform = target_platform()
    if platform != "gpu":
        say(f"flash_attention auto: platform {platform!r} has no Pallas GPU kernels; "
            f"using {CPU_DEFAULT!r} (pass interpret=True or impl='triton' to run the kernels)")
        return CPU_DEFAULT
    cc = compute_capability() or (0, 0)
    manual = in_manual_axes() if manual is None else manual
    return _on_gpu(cc, dtype, head_dim, segment_ids, manual, seq_len, say,
                   {} if plan else _REFUSED)


def _dense_mask_work(seq_len: int | None) -> str:
    """Why packed documents go to our kernels, with the tile counts when the length is known."""
    why = ("packed documents (segment ids): cuDNN takes them only as a dense [S, S] mask, "
           "computing every score and streaming an S^2 bias per head, while ours skip the key "
           "tiles before each query tile's document start")
    if seq_len:
        n = -(-seq_len // 128)
        why += (f" (S={seq_len} in 128 x 128 tiles: cuDNN {n * n}, ours at most the "
                f"{causal_tiles(n, 128, 128, seq_len)} causal ones, fewer with each document "
                "boundary)")
    return why


def _on_gpu(cc, dtype, head_dim: int, segment_ids: bool, manual: bool, seq_len=None,
            say=_log_once, refusals=None) -> str:
    refusals = _REFUSED if refusals is None else refusals  # {}: planning, before any check
    # Kernels a GPU run recorded failing here (measured.FAILED) are refused even when planning:
    # no check is spent on a kernel known to hang.
    refusals = {**refusals, **{
        k: f"a GPU run recorded it failing on compute capability {cc[0]}.x: {why}"
        for k in KERNEL_IMPLS if (why := measured.failed(k, cc, segment_ids))}}
    vendor = backend(GPU_VENDOR)
    ours = our_kernel(cc, dtype, head_dim)
    won = ours is not None and measured.ours_won("attention", cc, ours)
    # Why the vendor path would do more work or cannot take this call at all.
    vendor_out = (_dense_mask_work(seq_len) if segment_ids and vendor.dense_segment_mask else
                  "cuDNN attention does not compile inside jax.shard_map"
                  if manual and not vendor.in_shard_map else None)
    if ours is not None and (won or vendor_out):
        why = (f"{measured.WHERE} records it beating cuDNN on compute capability {cc[0]}.{cc[1]}"
               if won else vendor_out)
        return _unless_refused(ours, f"flash_attention auto: using {ours!r}: {why}",
                               refusals, dtype, manual, say)
    if vendor_out:
        return _unless_refused(
            GPU_FALLBACK, f"flash_attention auto: no titanax kernel for compute capability "
            f"{cc[0]}.{cc[1]}, {jnp.dtype(dtype).name}, head_dim {head_dim}; using "
            f"{GPU_FALLBACK!r} (cuDNN cannot take segment ids or shard_map bodies here)",
            refusals, dtype, manual, say)
    say(f"flash_attention auto: using {GPU_VENDOR!r} (causal mask type, no dense mask) "
        f"on compute capability {cc[0]}.{cc[1]}: without packed documents both compute "
        f"the causal half of the scores, and no benchmark in {measured.WHERE} shows a "
        f"titanax kernel faster there (ours stay one impl= away: {', '.join(KERNEL_IMPLS)})")
    return GPU_VENDOR


def _unless_refused(kernel: str, line: str, refusals: dict, dtype, manual: bool, say) -> str:
    """`kernel`, logging `line`, unless it is refused in this process: then cuDNN where it can
    take the call, else the XLA reference, logging why."""
    if kernel not in refusals:
        say(line)
        return kernel
    # cuDNN's fused attention takes fp16/bf16 only, and does not compile in shard_map bodies.
    why_not = ("inside jax.shard_map, where cuDNN does not compile"
               if manual and not backend(GPU_VENDOR).in_shard_map else
               f"cuDNN attention takes fp16/bf16, not {jnp.dtype(dtype).name}"
               if jnp.dtype(dtype).name not in _CUDNN_DTYPES else None)
    instead = REFERENCE if why_not else GPU_VENDOR
    say(f"flash_attention auto: not {kernel!r}, refused ({refusals[kernel]}); "
        f"using {instead!r}" + (f" ({why_not})" if why_not else ""))
    return instead
