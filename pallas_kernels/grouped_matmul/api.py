"""grouped_matmul(x [M, K], w [G, K, N], sizes [G]) -> [M, N]: rows [start_g, start_g + sizes[g])
of x times w[g], the grouped GEMM of a mixture-of-experts layer (rows sorted by expert). Rows
past sum(sizes) come out zero.

Backends (IMPLS):
  xla          jax.lax.ragged_dot: exact on CPU; XLA's GPU compiler lowers it to a DENSE dot
               over every (row, group) pair (a deviceless H100 compile of 65,536 rows x 128
               experts of [2048, 768]: dot(f32[65536, 262144]), 34 GB of temporaries and
               G x the FLOPs), so it is the reference and the CPU path, never a GPU one.
  mosaic_sm90  jax's Mosaic GPU kernels for Hopper (jax.experimental.pallas.ops.gpu):
               ragged_dot_mgpu (TMA + wgmma, persistent over the SMs, one output tile per
               (group, row block)) for the output and dx (w transposed in SMEM), and
               transposed_ragged_dot_mgpu for dw = x_g^T dy_g; wrapped in a custom VJP.
               Operands in one 16-bit dtype, fp32 accumulation, the output in x's dtype.
`auto` (resolve_impl): mosaic_sm90 when compiling for a Hopper GPU, else xla (B200 keeps the
dense lowering until a tcgen05 backend is added: jax's blackwell_ragged_dot_mgpu has no weight
gradient).
"""

from __future__ import annotations

import contextlib
import functools
import math
import types

import jax
import jax.numpy as jnp

from ..mosaic_interpret import interpret_ctx
from ..target import compute_capability, sm_count, target_platform
from .backends import GROUPED, IMPLS, REFERENCE, grouped, load
from .config import GroupedMatmulConfig

__all__ = ["IMPLS", "grouped_matmul", "resolve_impl"]


def resolve_impl(impl: str, dtype=jnp.bfloat16) -> str:
    """`auto` -> the table's kernel for the compile target's GPU generation that takes this
    operand width (mosaic_sm90: 16-bit operands on Hopper), else the XLA reference; any other
    name is checked against the table (backends.py)."""
    if impl != "auto":
        return grouped(impl).name
    cc = compute_capability() if target_platform() == "gpu" else None
    width = jnp.dtype(dtype).itemsize
    ours = [g.name for g in GROUPED.values() if cc is not None and g.compute_capability == cc[0]
            and g.operand_bytes in (None, width)]
    return ours[0] if ours else REFERENCE


def grouped_matmul(x, w, sizes, *, impl: str = "auto", config: GroupedMatmulConfig | None = None,
                   interpret: bool = False, preferred_element_type=None):
    """x [M, K], w [G, K, N], sizes int32 [G] -> [M, N]. preferred_element_type: the xla
    backend's output dtype (fp32 keeps its accumulation); the Mosaic one returns x's dtype.
    interpret: run the Mosaic kernels in the Mosaic GPU interpreter (CPU tests)."""
    run = load(grouped(resolve_impl(impl, x.dtype)).run)
    return run(x, w, sizes, config=config, interpret=interpret,
               preferred_element_type=preferred_element_type)


def ragged_dot_xla(x, w, sizes, *, config, interpret, preferred_element_type):
    """The xla entry: jax.lax.ragged_dot (no config; runs anywhere)."""
    del config, interpret
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=preferred_element_type)


def grouped_matmul_sm90(x, w, sizes, *, config, interpret, preferred_element_type):
    """The mosaic_sm90 entry: the operands and tiles checked, then the kernels with their
    custom VJP; the output in x's dtype (preferred_element_type is the xla entry's)."""
    del preferred_element_type
    impl = "mosaic_sm90"
    cfg = config or GroupedMatmulConfig()
    if x.dtype != w.dtype or jnp.dtype(x.dtype).itemsize != 2:
        raise ValueError(f"grouped matmul {impl}: x and w in one 16-bit dtype (wgmma operands), "
                         f"got {x.dtype} and {w.dtype}")
    tile = math.lcm(cfg.block_m, cfg.block_n, cfg.block_k)
    if x.shape[1] % tile or w.shape[2] % tile:
        # K and N each serve as contraction, output width and dw's rows across the three GEMMs.
        raise ValueError(f"grouped matmul {impl}: K={x.shape[1]} and N={w.shape[2]} must be "
                         f"multiples of {tile} (the config's block sizes)")
    return _mosaic(x, w, sizes.astype(jnp.int32), cfg, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _mosaic(x, w, sizes, cfg, interpret):
    return _forward(x, w, sizes, cfg, interpret, transpose_rhs=False)


def _mosaic_fwd(x, w, sizes, cfg, interpret):
    return _mosaic(x, w, sizes, cfg, interpret), (x, w, sizes)


def _mosaic_bwd(cfg, interpret, res, dy):
    x, w, sizes = res
    dy = dy.astype(x.dtype)
    dx = _forward(dy, w, sizes, cfg, interpret, transpose_rhs=True)
    dw = _weight_grad(x, dy, sizes, cfg, interpret)
    return _as_cotangent(dx, x, dy, w), _as_cotangent(dw, w, x, dy), None


def _vma(a) -> frozenset:
    """The manual mesh axes a value varies over inside a shard_map (empty outside one)."""
    return jax.typeof(a).mat.varying


def _varying(y, *sources):
    """A kernel's output y, whose type carries no varying mesh axes (Mosaic GPU calls do not
    propagate them), typed as varying over every axis its sources vary over inside a
    shard_map: what it is. Without it a psum of y would count it as replicated (x axis size)."""
    have = frozenset().union(*(_vma(s) for s in sources))
    missing = tuple(sorted(have - _vma(y)))
    return jax.lax.pcast(y, missing, to="varying") if missing else y


def _as_cotangent(ct, primal, *sources):
    """ct, computed by a kernel from `sources`, with primal's type: summed over the axes the
    sources vary over and the primal does not (the transpose of the implicit broadcast that
    met them in the forward, e.g. a weight replicated over the token shards: its gradient is
    the sum of theirs), as vma-checked autodiff would."""
    ct = _varying(ct, *sources)
    extra = tuple(sorted(_vma(ct) - _vma(primal)))
    ct = jax.lax.psum(ct, extra) if extra else ct
    return _varying(ct, primal)


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)


def _forward(x, w, sizes, cfg, interpret, *, transpose_rhs):
    """x [M, K] @ w[g] (or w[g]^T) per row group; rows past the groups zeroed (the kernel
    leaves them unwritten)."""
    y = _ragged_dot_kernel(x, w, sizes, cfg, interpret, transpose_rhs)
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    return _varying(jnp.where(rows < jnp.sum(sizes), y, jnp.zeros((), y.dtype)), x, w, sizes)


def _ragged_dot_kernel(x, w, sizes, cfg, interpret, transpose_rhs):
    """jax's Mosaic GPU ragged_dot as it is (rows past the groups unwritten)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    with interpret_ctx(interpret):
        return ragged_dot_mgpu.ragged_dot(
            x, w, group_sizes=sizes, block_m=cfg.block_m, block_n=cfg.block_n,
            block_k=cfg.block_k, max_concurrent_steps=cfg.max_concurrent_steps,
            grid_block_n=cfg.grid_block_n, transpose_rhs=transpose_rhs)


def _weight_grad(x, dy, sizes, cfg, interpret):
    """dw[g] = x_g^T dy_g: [G, K, N], jax's Mosaic GPU transposed_ragged_dot."""
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as trd

    with interpret_ctx(interpret), _sm_count_for(trd):
        return trd.transposed_ragged_dot(
            x, dy, group_sizes=sizes, block_m=cfg.block_m, block_n=cfg.block_n,
            block_k=cfg.block_k, max_concurrent_steps=cfg.max_concurrent_steps,
            grid_block_n=cfg.grid_block_n)


@contextlib.contextmanager
def _sm_count_for(module):
    """jax 0.11.2's transposed_ragged_dot sizes its persistent grid from
    jax.devices()[0].core_count, which a deviceless compile (CPU devices standing in for the
    GPU) and the interpreter do not have: for the call, the module sees the target's SM count
    (target.sm_count: the compile target's, or H100 SXM's 132 in the interpreter)."""
    sms = sm_count() or 132
    real = module.jax
    shim = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real)
                                    if not k.startswith("__")})
    shim.devices = lambda *a, **k: [types.SimpleNamespace(core_count=sms)]
    module.jax = shim
    try:
        yield
    finally:
        module.jax = real
