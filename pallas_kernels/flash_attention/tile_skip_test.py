"""Tile skipping with packed documents (tile_ranges.py) in the grid kernels (Triton backend,
Pallas interpret mode) and the Hopper Mosaic kernels (Mosaic GPU interpreter, shipped configs).

tile_ranges itself is checked against the dense mask (every visible tile inside [lo, hi), the
bounds exact for monotone ids, [full_lo, full_hi) wholly visible) and against the work count of
the issue: 2k-token documents in 8k windows visit at least 3x fewer tiles than plain causal.

The kernels are checked through the context-parallel block API (flash_block_fwd/bwd: keys
with their own segment ids), so that whole tiles of keys, and whole tiles of queries, see
nothing. Every position that no launched kernel's ranges cover (keys and values outside
every visited column tile, queries and output gradients outside every dK/dV range) is NaN,
while the reference runs on the clean inputs: a kernel that reads a skipped tile gets NaN
(0 * NaN in P V) and fails (widening any one kernel's ranges, forward, dq or dkv, by one tile
makes these tests fail). Rows with no visible key must come out zero with a finite,
MASK-scale log-sum-exp. The sm90 cases hold a CTA whose warpgroups both see nothing, one
where only one does (it drains the other's tiles), GQA heads looping in dkv, and tiles wholly
inside one document (the unmasked path). Error = max |x - ref| / max |ref|: fp32 within 2e-5,
bf16 2e-2.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import default_config, kernel_bwd, kernel_fwd, kernel_sm90
from pallas_kernels.flash_attention.api import flash_block_bwd, flash_block_fwd
from pallas_kernels.flash_attention.backend_xla import block_reference_bwd, block_reference_fwd
from pallas_kernels.flash_attention.config import FlashConfig
from pallas_kernels.flash_attention.kernel_sm90_bwd import MAX_BWD_HEAD_DIM
from pallas_kernels.flash_attention.tile_ranges import (
    causal_tiles,
    tile_ranges,
    visited_tiles,
)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
SMALL = FlashConfig(block_q=32, block_kv=32, block_q_bwd=32, block_kv_bwd=32)
FOREIGN = 1000  # a document id no query carries
# One compile per geometry instead of one per jnp op (eager dispatch compiles each).
_ranges = jax.jit(tile_ranges, static_argnames=("rows", "cols", "causal", "kv_len",
                                                "transposed"))


def _ids(B, n, cuts_per_row):
    """[B, n] monotone segment ids, documents starting at each row's cuts."""
    return np.stack([np.searchsorted(np.asarray(c, int), np.arange(n), side="right")
                     for c in cuts_per_row]).astype(np.int32)


# ---- tile_ranges on its own -------------------------------------------------------------------

def _dense_visible(q_seg, kv_seg, causal, kv_len):
    S, T = q_seg.shape[1], kv_seg.shape[1]
    vis = (q_seg[:, :, None] == kv_seg[:, None, :]) & (np.arange(T) < kv_len)[None, None]
    if causal:
        vis &= np.arange(T)[None, None, :] <= np.arange(S)[None, :, None]
    return vis


@pytest.mark.parametrize("causal", [True, False])
def test_tile_ranges_match_the_dense_mask(causal):
    rng = np.random.default_rng(0)
    B, S, rows, cols, kv_len = 3, 192, 32, 16, 181
    # Monotone ids (as the data pipeline writes), one document, and a shuffled row.
    cuts = [np.sort(rng.choice(np.arange(1, S), 7, replace=False)), [], [40, 100]]
    q_seg = _ids(B, S, cuts)
    kv_seg = q_seg.copy()
    kv_seg[2] = rng.permutation(kv_seg[2])  # not sorted: bounds stay safe, not exact
    if not causal:
        kv_seg[1] = 5  # a block of another document: every row of batch 1 is empty
    vis = _dense_visible(q_seg, kv_seg, causal, kv_len)
    for transposed in (False, True):
        r = np.asarray(tile_ranges(q_seg, kv_seg, rows=rows, cols=cols, causal=causal,
                                   kv_len=kv_len, transposed=transposed))
        tiles = vis.reshape(B, S // rows, rows, S // cols, cols).any(axis=(2, 4))
        full = vis.reshape(B, S // rows, rows, S // cols, cols).all(axis=(2, 4))
        if transposed:
            t = vis.transpose(0, 2, 1)
            tiles = t.reshape(B, S // rows, rows, S // cols, cols).any(axis=(2, 4))
            full = t.reshape(B, S // rows, rows, S // cols, cols).all(axis=(2, 4))
        c = np.arange(tiles.shape[-1])
        lo, flo, fhi, hi = (r[..., i, None] for i in range(4))
        inside = (lo <= c) & (c < hi)
        assert not (tiles & ~inside).any()  # no visible tile is skipped
        assert (full[(flo <= c) & (c < fhi)]).all()  # the unmasked run needs no mask
        assert ((lo <= flo) & (flo <= fhi) & (fhi <= hi)).all()
        for b in (0, 1):  # monotone ids: [lo, hi) is exactly first to last visible tile
            any_ = tiles[b].any(-1)
            first = np.where(any_, tiles[b].argmax(-1), 0)
            last = np.where(any_, tiles.shape[-1] - tiles[b][:, ::-1].argmax(-1), 0)
            np.testing.assert_array_equal(r[b, :, 0], first)
            np.testing.assert_array_equal(r[b, :, 3], last)
        if not causal:
            assert (r[1, :, 0] == r[1, :, 3]).all()  # nothing to see: lo == hi


def test_two_k_documents_in_8k_windows_visit_3x_fewer_tiles():
    S, doc = 8192, 2048
    seg = jnp.asarray(np.arange(S) // doc, jnp.int32)[None]
    for rows, cols in ((128, 128), (64, 128), (64, 64)):  # grid/sm100 fwd, sm90 fwd, bwd
        r = _ranges(seg, seg, rows=rows, cols=cols, causal=True, kv_len=S)
        visited = int(visited_tiles(r))
        assert 3 * visited <= causal_tiles(S // rows, rows, cols, S), (rows, cols, visited)
        rt = _ranges(seg, seg, rows=cols, cols=rows, causal=True, kv_len=S, transposed=True)
        assert int(visited_tiles(rt)) == visited  # dK/dV visit the same tiles
    # The docstring's count at 128 x 128: 544 of 2,080.
    r = _ranges(seg, seg, rows=128, cols=128, causal=True, kv_len=S)
    assert int(visited_tiles(r)) == 544 and causal_tiles(64, 128, 128, S) == 2080


# ---- the kernels, with NaN where no tile may be read --------------------------------------------

def _geometry(impl, D, cfg):
    """(pad multiples, [(rows, cols, transposed)] of the forward, dq and dkv launches)."""
    if impl == "triton":
        fwd = bwd = cfg
        mult = kernel_fwd.pad_multiples(cfg)
    else:
        fwd = default_config(impl, D)
        bwd = fwd if D <= MAX_BWD_HEAD_DIM else default_config("triton", D)  # grid backward
        mult = kernel_sm90.pad_multiples(fwd)
    return mult, [(fwd.block_q, fwd.block_kv, False), (bwd.block_q_bwd, bwd.block_kv_bwd, False),
                  (bwd.block_kv_bwd, bwd.block_q_bwd, True)]


def _needed(q_seg, kv_seg, impl, D, cfg, causal):
    """Boolean [B, S], [B, T]: the queries and keys whose tiles some launch computes with."""
    (mq, mk), geoms = _geometry(impl, D, cfg)
    S, T = q_seg.shape[1], kv_seg.shape[1]
    pad = lambda x, m: np.pad(x, ((0, 0), (0, -x.shape[1] % m)), mode="edge")
    qp, kp = pad(q_seg, mq), pad(kv_seg, mk)
    need = {False: np.zeros(qp.shape, bool), True: np.zeros(kp.shape, bool)}  # key axis?
    for rows, cols, transposed in geoms:
        r = np.asarray(_ranges(qp, kp, rows=rows, cols=cols, causal=causal, kv_len=T,
                               transposed=transposed))
        lo, hi = r[..., 0], r[..., 3]
        n_cols = (qp if transposed else kp).shape[1] // cols
        c = np.arange(n_cols)
        col_seen = ((lo[..., None] <= c) & (c < hi[..., None])).any(axis=1)
        need[transposed] |= np.repeat(lo < hi, rows, axis=1)  # rows: keys when transposed
        need[not transposed] |= np.repeat(col_seen, cols, axis=1)
    return need[False][:, :S], need[True][:, :T]


def _rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(x))
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def _check_block(impl, cfg, *, q_seg, kv_seg, causal, G, D, dtype, min_poisoned,
                 backward=True):
    """flash_block_fwd/bwd on NaN-poisoned inputs vs the block reference on clean ones."""
    B, S = q_seg.shape
    T = kv_seg.shape[1]
    ks = jax.random.split(jax.random.key(0), 5)
    q, do = (jax.random.normal(k, (B, S, G, D)).astype(dtype) for k in ks[:2])
    k, v = (jax.random.normal(k, (B, T, 1, D)).astype(dtype) for k in ks[2:4])
    q_need, k_need = _needed(q_seg, kv_seg, impl, D, cfg, causal)
    # Batch 0 skips part of its tiles, by both measures (batch 1 may skip all or none).
    assert (~q_need[0]).sum() >= min_poisoned and (~k_need[0]).sum() >= min_poisoned
    nan_q = lambda x: jnp.where(q_need[:, :, None, None], x, jnp.nan).astype(dtype)
    nan_k = lambda x: jnp.where(k_need[:, :, None, None], x, jnp.nan).astype(dtype)
    qs, ks_ = jnp.asarray(q_seg), jnp.asarray(kv_seg)
    kw = dict(causal=causal, impl=impl, config=cfg, interpret=True)
    f32 = lambda *xs: [x.astype(jnp.float32) for x in xs]

    out, lse = jax.jit(functools.partial(flash_block_fwd, **kw))(nan_q(q), nan_k(k), nan_k(v),
                                                                   qs, ks_)
    out_ref, lse_ref = jax.jit(functools.partial(block_reference_fwd, causal=causal))(
        *f32(q, k, v), qs, ks_)
    sees = _dense_visible(q_seg, kv_seg, causal, T).any(-1)  # [B, S]: a visible key
    tol = TOL[dtype]
    assert _rel_err(jnp.where(sees[..., None, None], out, 0),
                    jnp.where(sees[..., None, None], out_ref, 0)) < tol
    lse_err = np.abs(np.where(sees[:, None], lse - lse_ref, 0)).max()
    assert lse_err < tol * np.abs(np.where(sees[:, None], lse_ref, 0)).max()
    # Rows of tiles that see nothing: no NaN from their poisoned Q, zero out, finite lse.
    assert np.isfinite(np.asarray(lse)).all()
    empty = ~q_need
    assert (np.asarray(out, np.float32)[empty] == 0).all()
    assert (np.asarray(lse).transpose(0, 2, 1)[empty] < -1e29).all()

    if not backward:
        return
    # The backward from a merged log-sum-exp, as context parallelism gives it: another block
    # of weight 1 (log 1 = 0) beside this one, so rows that see nothing here get p = 0.
    lse_in = jnp.logaddexp(lse_ref, 0.0)
    grads = jax.jit(functools.partial(flash_block_bwd, **kw))(
        nan_q(q), nan_k(k), nan_k(v), qs, ks_, out_ref.astype(dtype), lse_in, nan_q(do))
    grads_ref = jax.jit(functools.partial(block_reference_bwd, causal=causal))(
        *f32(q, k, v), qs, ks_, out_ref, lse_in, do.astype(jnp.float32))
    for name, x, r in zip(("dq", "dk", "dv"), grads, grads_ref):
        err = _rel_err(x, r)
        assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"


def _causal_case(S, tile):
    """Batch 0: short documents crossing tile edges; the first 1.5 tiles of keys belong to a
    document no query has (so those keys, and the queries before 1.5 tiles, see nothing: one
    query tile of the sm90 forward's second CTA is empty, the other not). Batch 1: one
    document, the same ids on both sides (self-attention's causal block)."""
    q_seg = _ids(2, S, [[tile // 2 + 3, 3 * tile // 2, 3 * tile // 2 + tile // 3,
                         3 * tile // 2 + tile // 3 + 9, 2 * tile + 17], []])
    kv_seg = q_seg.copy()
    kv_seg[0, :3 * tile // 2] = FOREIGN
    return q_seg, kv_seg


def _remote_case(S, T):
    """A block of earlier keys (context parallelism's non-causal block): in batch 0 the
    queries' first document began among these keys (after their first tile), the queries'
    later documents did not; batch 1's keys are all of another document: every row empty."""
    q_seg = _ids(2, S, [[S // 2 + 15, S // 2 + 35], []]) + 2
    kv_seg = _ids(2, T, [[T // 3, T // 2 + 30], []])
    kv_seg[1] = 9
    return q_seg, kv_seg


@pytest.mark.parametrize("causal", [True, False])
def test_triton_skipped_tiles_are_never_read(causal, monkeypatch):
    # The forward and dq kernels loop per mask kind on Hopper, in one loop elsewhere
    # (kernel_fwd.split_loops): the causal case runs the first, the other the second.
    monkeypatch.setattr(kernel_fwd, "split_loops", lambda: causal)
    monkeypatch.setattr(kernel_bwd, "split_loops", lambda: causal)
    if causal:
        q_seg, kv_seg = _causal_case(150, 32)
    else:
        q_seg, kv_seg = _remote_case(120, 100)
    _check_block("triton", SMALL, q_seg=q_seg, kv_seg=kv_seg, causal=causal, G=2, D=64,
                 dtype=jnp.float32, min_poisoned=20)


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize("causal, D, split", [(True, 128, False), (False, 64, False),
                                              (True, 256, False), (True, 128, True)])
def test_mosaic_sm90_skipped_tiles_are_never_read(causal, D, split):
    # Shipped configs: the forward's warpgroups take 64 rows each, two to a CTA, and stream
    # 128-key tiles (64 at head_dim 256); the backward at head_dim <= 128 is the fused kernel
    # (FlashConfig.bwd_fused: two 64-key consumers a CTA, 64-query tiles streamed), and with
    # split the dq and dkv kernels (64 x 64 tiles, two warpgroups a CTA), its A/B alternative.
    # At head_dim 256 the backward is the grid kernels' (checked above): forward only.
    cfg = dataclasses.replace(default_config("mosaic_sm90", D), bwd_fused=False) if split \
        else None
    if causal:
        q_seg, kv_seg = _causal_case(250, 128)
    else:
        q_seg, kv_seg = _remote_case(250, 200)
    _check_block("mosaic_sm90", cfg, q_seg=q_seg, kv_seg=kv_seg, causal=causal, G=2, D=D,
                 dtype=jnp.bfloat16, min_poisoned=50, backward=D <= MAX_BWD_HEAD_DIM)


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize("causal, D", [(True, 128), (False, 64)])
def test_mosaic_sm90_fwd_overlap_skipped_tiles_are_never_read(causal, D):
    # FlashConfig.fwd_overlap's pipelined loop (kernel_sm90.py): a warpgroup that sees no tile
    # opens no pipeline and drains; one that does opens it at its own first tile. Forward only:
    # the backward does not read the knob.
    cfg = dataclasses.replace(default_config("mosaic_sm90", D), fwd_overlap=True)
    q_seg, kv_seg = _causal_case(250, 128) if causal else _remote_case(250, 200)
    _check_block("mosaic_sm90", cfg, q_seg=q_seg, kv_seg=kv_seg, causal=causal, G=2, D=D,
                 dtype=jnp.bfloat16, min_poisoned=50, backward=False)
