"""Which tiles a flash attention kernel must visit when documents are packed: computed in XLA
from the segment ids, handed to the kernels as scalars.

A query tile needs a key tile only if some query of it may see some key of it. With packed
documents (segment ids) most key tiles before a query tile's first document start hold no key
it may see: with 2k-token documents in 8k windows and 128 x 128 tiles the causal kernels would
visit 2,080 tiles per (batch, head), of which 544 hold a visible key (3.8x less work). The
kernels skip the rest, and take their unmasked fast path on tiles that lie wholly inside the
query tile's one document (and left of the diagonal, and before the padded keys).

    ranges = tile_ranges(q_seg, kv_seg, rows=block_q, cols=block_kv, causal=..., kv_len=...)
    lo, full_lo, full_hi, hi = ranges[b, i]   # in units of column tiles

For query (row) tile i of batch row b: the column tiles [lo, hi) hold every key it may see
(tiles outside hold none); [full_lo, full_hi) within them need no mask at all. A kernel runs
masked [lo, full_lo), unmasked [full_lo, full_hi), masked [full_hi, hi). `transposed=True`
gives the same per key tile over query tiles (the dK/dV kernels' loop).

Nothing here assumes the segment ids are sorted. A column tile is skipped only when the
ranges of ids of the two tiles do not overlap, which proves no id is shared; lo and hi are
the first and last tiles that are not skipped. An unmasked tile is one whose keys and queries
all carry the same single id. For the monotone ids the data pipeline writes, both bounds are
exact at tile granularity.

A row tile with no visible column tile (a context-parallel block of keys from other
documents, padded query rows) gets lo == hi: the kernels then write a zero output and a
log-sum-exp of MASK-scale (finite), and add nothing in the backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# ranges[..., k]: which bound is where.
LO, FULL_LO, FULL_HI, HI = range(4)


def _tile_min_max(seg_BS, tile: int):
    """Per tile of `tile` positions: (min id, max id), [B, n]."""
    B, S = seg_BS.shape
    if S % tile:
        raise ValueError(f"a sequence of {S} is not a whole number of {tile}-position tiles "
                         "(pad the segment ids to the kernel's multiple first)")
    t = seg_BS.reshape(B, S // tile, tile)
    return t.min(axis=-1), t.max(axis=-1)


def _first_true(x, axis: int = -1, default=None):
    """Index of the first True along `axis`, or `default` (the axis length) where none."""
    n = x.shape[axis]
    idx = jnp.argmax(x, axis=axis).astype(jnp.int32)
    return jnp.where(x.any(axis=axis), idx, n if default is None else default)


def _last_true_end(x, axis: int = -1):
    """One past the index of the last True along `axis`, or 0 where none."""
    n = x.shape[axis]
    rev = jnp.flip(x, axis=axis)
    idx = jnp.argmax(rev, axis=axis).astype(jnp.int32)
    return jnp.where(x.any(axis=axis), n - idx, 0)


def tile_ranges(q_seg, kv_seg, *, rows: int, cols: int, causal: bool, kv_len: int,
                transposed: bool = False) -> jax.Array:
    """int32 [B, n_row_tiles, 4]: (lo, full_lo, full_hi, hi) per row tile (module docstring).

    q_seg [B, Sp], kv_seg [B, Tp]: the padded segment ids the kernel reads (Sp a multiple of
    the query tile, Tp of the key tile); kv_len: the real key count (keys at or past it are
    padding, never visible). rows/cols: the query and key tile sizes, or with transposed=True
    the key and query tile sizes (rows are then key tiles, columns query tiles). Causal
    means key t is visible to query s when t <= s (the same positions: S == T).
    """
    q_tile, k_tile = (cols, rows) if transposed else (rows, cols)
    q_min, q_max = _tile_min_max(q_seg.astype(jnp.int32), q_tile)  # [B, nq]
    k_min, k_max = _tile_min_max(kv_seg.astype(jnp.int32), k_tile)  # [B, nk]
    nq, nk = q_min.shape[1], k_min.shape[1]
    q0 = jnp.arange(nq, dtype=jnp.int32)[:, None] * q_tile  # first query of each tile
    k0 = jnp.arange(nk, dtype=jnp.int32)[None, :] * k_tile  # first key of each tile
    # [B, nq, nk]: the id ranges overlap (maybe a shared document), and position allows it.
    overlap = (q_min[:, :, None] <= k_max[:, None, :]) & (k_min[:, None, :] <= q_max[:, :, None])
    position = k0 < kv_len
    if causal:
        position = position & (k0 <= q0 + q_tile - 1)
    visible = overlap & position[None]
    # Every pair sees every other: one id on both sides, all keys real, all left of (or on)
    # the first query's diagonal.
    one_doc = ((q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]
               & (q_min[:, :, None] == k_min[:, None, :]))
    whole = k0 + k_tile <= kv_len
    if causal:
        whole = whole & (k0 + k_tile - 1 <= q0)
    full = one_doc & whole[None]
    if transposed:  # rows are key tiles: look along the query axis
        visible, full = jnp.swapaxes(visible, 1, 2), jnp.swapaxes(full, 1, 2)
    n_cols = visible.shape[-1]
    lo = _first_true(visible)
    hi = _last_true_end(visible)
    lo = jnp.minimum(lo, hi)  # no visible tile: lo == hi == 0
    full_lo = _first_true(full, default=None)
    # The unmasked run: from full_lo to the first tile after it that is not full.
    cols_idx = jnp.arange(n_cols, dtype=jnp.int32)
    after = (cols_idx[None, None, :] >= full_lo[..., None]) & ~full
    full_hi = jnp.where(full_lo < n_cols, _first_true(after), n_cols)
    # No unmasked tile: an empty run at hi, so the masked loops cover [lo, hi).
    empty = full_lo >= full_hi
    full_lo = jnp.where(empty, hi, full_lo)
    full_hi = jnp.where(empty, hi, full_hi)
    return jnp.stack([lo, full_lo, full_hi, hi], axis=-1).astype(jnp.int32)


def visited_tiles(ranges) -> jax.Array:
    """Tiles a kernel driven by these ranges computes, summed over batch and row tiles (per
    head): the work counter tests and benchmarks compare."""
    return jnp.sum(ranges[..., HI] - ranges[..., LO])


def causal_tiles(n_rows: int, rows: int, cols: int, kv_len: int) -> int:
    """Tiles the causal kernels visit per (batch row, head) without segment ids: the baseline
    visited_tiles is compared against."""
    n_cols = -(-kv_len // cols)
    return sum(min(n_cols, -(-((i + 1) * rows) // cols)) for i in range(n_rows))
