"""The Blackwell kernels (kernel_sm100.py forward, kernel_sm100_bwd.py dq and dkv) with packed
documents visit only the tiles tile_ranges.py gives them, take the unmasked path inside one
document, and still match the reference: in the Mosaic GPU interpreter, at the shipped configs.

A test that cannot pass unless tiles are really skipped: inputs are poisoned with NaN, and an
output must equal the reference (on the clean inputs) wherever the tiles its kernel visits
hold no NaN. A kernel reading a tile outside its range would carry the NaN into that output
(a masked score hides a NaN key, but P = 0 times a NaN value is NaN). Each case asserts that
some output it checks would have read a poisoned tile had its kernel visited every tile of
plain causal (or full) attention, so no case can pass vacuously:
  fwd  an out row tile sees no poisoned K/V tile in its range of block_kv-key tiles;
  dq   a dq row tile the same over block_kv_bwd-key tiles (its own Q/dO rows clean);
  dkv  a dK/dV block of 128 keys sees no poisoned Q/dO tile in its range of block_q_bwd-row
       tiles (its own K/V clean).
The backward gets the reference's out and log-sum-exp (context parallelism hands it the merged
ones), so its checks do not depend on the forward's. Rows that see no key at all (blocks of
context parallelism whose keys are other documents) come in whole tiles here: there the
forward writes 0 and a finite MASK-scale log-sum-exp, and the backward adds nothing.

Error = max |x - ref| / max |ref| over the checked entries, within bf16's 2e-2 (flash_attention
_test.py). The interpreter pays per CTA, so the shapes are a few 128-row tiles and every case
packs its document layouts into the batch (one kernel compile per case).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import default_config
from pallas_kernels.flash_attention.api import flash_block_bwd, flash_block_fwd
from pallas_kernels.flash_attention.backend_xla import block_reference_bwd, block_reference_fwd
from pallas_kernels.flash_attention.kernel_sm100 import BLOCK_Q, pad_multiples
from pallas_kernels.flash_attention.mosaic_common import MASK
from pallas_kernels.flash_attention.pair import _pad_segments
from pallas_kernels.flash_attention.tile_ranges import FULL_HI, FULL_LO, HI, LO, tile_ranges

pytestmark = pytest.mark.mosaic_interpret

TOL = 2e-2  # bf16 inputs and P, float32 accumulation
# The log-sum-exp: scores are exact bf16 products summed in float32, exp2/log2 approximate to
# about 2^-22 (approx_math); 1e-4 of the largest leaves two orders of magnitude of room.
LSE_TOL = 1e-4
LN2 = float(np.log(2.0))
LSE_EMPTY = MASK * LN2  # natural-log units: what an empty row tile's log-sum-exp is


def _ids(*lengths):
    """Segment ids of documents of these lengths, back to back."""
    return np.repeat(np.arange(len(lengths)), lengths)


def _ranges(q_seg, kv_seg, *, causal, kv_len, cfg):
    """Each kernel's tile ranges, at its own geometry, from the ids it reads (padded as
    api.py pads them): {kernel: (ranges [B, n, 4], rows per range, columns per tile)}."""
    geometry = {"fwd": (cfg.block_kv, False), "dq": (cfg.block_kv_bwd, False),
                "dkv": (cfg.block_q_bwd, True)}
    ranges = _all_ranges(q_seg, kv_seg, causal=causal, kv_len=kv_len, cfg=cfg,
                         geometry=tuple(geometry.values()))
    return {name: (np.asarray(r), BLOCK_Q, cols)
            for (name, (cols, _)), r in zip(geometry.items(), ranges)}


@functools.partial(jax.jit, static_argnames=("causal", "kv_len", "cfg", "geometry"))
def _all_ranges(q_seg, kv_seg, *, causal, kv_len, cfg, geometry):
    mq, mk = pad_multiples(cfg)
    qp = _pad_segments(q_seg, -(-q_seg.shape[1] // mq) * mq)
    kp = _pad_segments(kv_seg, -(-kv_seg.shape[1] // mk) * mk)
    return [tile_ranges(qp, kp, rows=BLOCK_Q, cols=cols, causal=causal, kv_len=kv_len,
                        transposed=transposed) for cols, transposed in geometry]


def _tiles(bad, size):
    """bool [B, n]: the tiles of `size` positions holding a poisoned one (padding is clean)."""
    B, L = bad.shape
    n = -(-L // size)
    return np.pad(bad, ((0, 0), (0, n * size - L))).reshape(B, n, size).any(-1)


def _checked(ranges, own_bad, other_bad, *, causal, transposed=False):
    """Per kernel, bool [B, its rows]: the outputs that must be exact (the range is empty, or
    its own rows and the tiles it visits are clean) and those whose range is empty; and how
    many checked row tiles would have met a poisoned tile in the plain causal (or full)
    range, without documents: the proof that tiles were skipped."""
    r, rows, cols = ranges
    r = np.asarray(r)
    B, n = r.shape[:2]
    bad_tile, own = _tiles(other_bad, cols), _tiles(own_bad, rows)
    n_cols = bad_tile.shape[1]
    ok = np.zeros((B, n), bool)
    proof = 0
    for b, i in np.ndindex(B, n):
        lo, hi = r[b, i, LO], r[b, i, HI]
        assert lo <= r[b, i, FULL_LO] <= r[b, i, FULL_HI] <= hi <= n_cols
        ok[b, i] = lo == hi or not (own[b, i] or bad_tile[b, lo:hi].any())
        plain = (0, n_cols)  # the tiles the kernel visits without segment ids
        if causal:
            plain = (i * rows // cols, n_cols) if transposed else (0, -(-(i + 1) * rows // cols))
        proof += int(ok[b, i] and lo < hi and bad_tile[b, plain[0]:plain[1]].any())
    empty = r[..., HI] == r[..., LO]
    return np.repeat(ok, rows, axis=1), np.repeat(empty, rows, axis=1), proof


def _unneeded(ranges, S, T):
    """(queries [B, S], keys [B, T]) that no kernel reads: outside every visited range."""
    q_need, k_need = np.bool_(False), np.bool_(False)  # broadcast to [B, S], [B, T]
    for name, (r, rows, cols) in ranges.items():
        r = np.asarray(r)
        B, n = r.shape[:2]
        own = np.repeat(r[..., HI] > r[..., LO], rows, axis=1)
        other = np.zeros((B, max(S, T)), bool)  # (slices past the end are clipped)
        for b, i in np.ndindex(B, n):
            other[b, r[b, i, LO] * cols:r[b, i, HI] * cols] = True
        q, k = (other, own) if name == "dkv" else (own, other)
        q_need, k_need = q_need | q[:, :S], k_need | k[:, :T]
    return ~q_need, ~k_need


def _check(name, x, ref, where, tol=TOL):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    where = np.broadcast_to(where, x.shape)
    assert where.any(), f"{name}: nothing to check"
    assert np.all(np.isfinite(x[where])), f"{name}: NaN in a checked entry (a skipped tile read)"
    err = float(np.max(np.abs(x - ref)[where]) / np.max(np.abs(ref)[where]))
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol}"


def _poison(x, bad):
    return jnp.where(bad[:, :, None, None], jnp.nan, x).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("causal", "backward"))
def _outputs(q, k, v, do, q_seg, kv_seg, q_bad, k_bad, sees, *, causal, backward):
    """(kernels', reference's) (out, lse[, dq, dk, dv]): the kernels on the poisoned inputs,
    the reference on the clean ones. One jit: a single compile of the tile ranges and the
    reference around the interpreted kernels."""
    kw = dict(causal=causal, impl="mosaic_sm100", interpret=True)
    qn, kn, vn, don = _poison(q, q_bad), _poison(k, k_bad), _poison(v, k_bad), _poison(do, q_bad)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = block_reference_fwd(*f32, q_seg, kv_seg, causal=causal)
    got = flash_block_fwd(qn, kn, vn, q_seg, kv_seg, **kw)
    if backward:  # from the reference's out and lse: rows that see no key as the kernel has them
        out_in = jnp.where(sees[:, :, None, None], ref[0], 0).astype(q.dtype)
        lse_in = jnp.where(sees[:, None, :], ref[1], LSE_EMPTY)
        got += flash_block_bwd(qn, kn, vn, q_seg, kv_seg, out_in, lse_in, don, **kw)
        ref += block_reference_bwd(*f32, q_seg, kv_seg, out_in.astype(jnp.float32), lse_in,
                                   do.astype(jnp.float32), causal=causal)
    return got, ref


def _inputs(B, S, T, Hq, Hkv, D):
    kq, kk, kv, kd = jax.random.split(jax.random.key(0), 4)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    return (normal(kq, (B, S, Hq, D)), normal(kk, (B, T, Hkv, D)), normal(kv, (B, T, Hkv, D)),
            normal(kd, (B, S, Hq, D)))


def _run(*, q_seg, kv_seg, causal, Hq, Hkv, D, q_bad=None, k_bad=None, backward=True,
         proves=()):
    """q_bad [B, S], k_bad [B, T]: where Q/dO and K/V get NaN (None: every position that no
    kernel reads). proves: the kernels whose skipping this case must show."""
    q_seg, kv_seg = np.asarray(q_seg, np.int32), np.asarray(kv_seg, np.int32)
    (B, S), T = q_seg.shape, kv_seg.shape[1]
    cfg = default_config("mosaic_sm100", D)
    ranges = _ranges(q_seg, kv_seg, causal=causal, kv_len=T, cfg=cfg)
    if q_bad is None:
        q_bad, k_bad = _unneeded(ranges, S, T)
    assert q_bad.any() or k_bad.any()
    # Queries that see some key; the others get O = 0 and a MASK-scale log-sum-exp.
    visible = q_seg[:, :, None] == kv_seg[:, None, :]
    if causal:
        visible &= np.arange(T)[None, None, :] <= np.arange(S)[None, :, None]
    sees = visible.any(-1)
    got, ref = _outputs(*_inputs(B, S, T, Hq, Hkv, D), q_seg, kv_seg, q_bad, k_bad, sees,
                        causal=causal, backward=backward)
    # As the kernels see them: padded to whole 128-row blocks (the padding is clean).
    mq, mk = pad_multiples(cfg)
    q_bad, k_bad = np.pad(q_bad, ((0, 0), (0, -S % mq))), np.pad(k_bad, ((0, 0), (0, -T % mk)))
    ok, empty, proof = _checked(ranges["fwd"], q_bad, k_bad, causal=causal)
    ok, empty = ok[:, :S], empty[:, :S]
    assert not np.any(empty & sees), "a row tile that sees a key has an empty range"
    _check("out", got[0], ref[0], (ok & sees)[:, :, None, None])
    _check("lse", got[1], ref[1], (ok & sees)[:, None, :], tol=LSE_TOL)
    assert np.all(np.asarray(got[0])[empty] == 0), "out: not 0 where no key is seen"
    lse_empty = np.asarray(got[1]).transpose(0, 2, 1)[empty]
    assert np.all(np.isfinite(lse_empty) & (lse_empty <= 0.5 * LSE_EMPTY))
    proofs = {"fwd": proof}
    if backward:
        ok_q, _, proofs["dq"] = _checked(ranges["dq"], q_bad, k_bad, causal=causal)
        ok_k, _, proofs["dkv"] = _checked(ranges["dkv"], k_bad, q_bad, causal=causal,
                                          transposed=True)
        checks = {"dq": ok_q[:, :S], "dk": ok_k[:, :T], "dv": ok_k[:, :T]}
        for (name, where), x, r in zip(checks.items(), got[2:], ref[2:]):
            _check(name, x, r, where[:, :, None, None])
    for name in proves:
        assert proofs[name] > 0, f"{name}: no checked output would have met a poisoned tile"


def _stack(*rows):
    return np.stack([np.asarray(r) for r in rows])


def test_causal_documents_hd64():
    # S = 250: two query tiles, keys past 250 padding. Row 0: documents crossing the 64-key
    # tile edges, one starting at 128; K/V poisoned in keys 0-127, which the second query tile
    # no longer reaches (fwd, dq). Row 1: a document crossing the 128 edge, Q/dO poisoned in
    # queries 192-249, which key block 0 (documents ending at 190) no longer reaches (dkv).
    # Row 2: one document, every tile left of the diagonal unmasked.
    S = 250
    seg = _stack(_ids(50, 78, 40, 82), _ids(45, 70, 75, 60), _ids(250))
    k_bad, q_bad = np.zeros((3, S), bool), np.zeros((3, S), bool)
    k_bad[0, :128] = True
    q_bad[1, 192:] = True
    _run(q_seg=seg, kv_seg=seg, causal=True, Hq=1, Hkv=1, D=64, q_bad=q_bad, k_bad=k_bad,
         proves=("fwd", "dq", "dkv"))


def test_context_parallel_blocks_gqa_hd128():
    # flash_block_fwd/bwd as context parallelism calls them: not causal, a block of keys from
    # elsewhere in the sequence with ids of its own; 2 q heads per kv head (summed in dkv).
    # Row 0: queries 0-127 are a document none of these keys belong to (an empty row tile),
    # queries 128-255 see keys 0-127 whole (unmasked); keys 128-255 are a document no query
    # here belongs to. Row 1: disjoint ids, every row empty. NaN wherever no kernel reads.
    q_seg = _stack(_ids(128, 128), np.full(256, 5))
    kv_seg = _stack(_ids(0, 128, 128), np.full(256, 6))
    _run(q_seg=q_seg, kv_seg=kv_seg, causal=False, Hq=2, Hkv=1, D=128,
         proves=("fwd", "dq", "dkv"))


def test_causal_hd256_forward():
    # head_dim 256: 64-key tiles in the forward (its backward is the grid kernels'). The second
    # query tile starts inside a document beginning at 70: keys 0-63 are skipped.
    seg = _ids(70, 186)[None]
    k_bad = np.zeros((1, 256), bool)
    k_bad[0, :64] = True
    _run(q_seg=seg, kv_seg=seg, causal=True, Hq=1, Hkv=1, D=256, q_bad=np.zeros_like(k_bad),
         k_bad=k_bad, backward=False, proves=("fwd",))
