"""THE backend suite: every entry of backends.BACKENDS against the reference, values and
gradients, on one list of cases (causal and not, GQA, packed documents causal and not, more
keys than queries, KV-cache decoding), with no per-backend code: a new table entry is
picked up as it is.

How each entry runs on a CPU, read from the table: our Pallas kernel pairs in their
interpreter (interpret=True: the Triton-style grid kernels in Pallas interpret mode, Mosaic
GPU kernels in the Mosaic GPU interpreter, which runs warpgroups, mbarriers, TMA, wgmma,
tcgen05 and TMEM); the others as they are. On a CPU `cudnn` is jax.nn.dot_product_attention's
XLA implementation, so this checks what titanax hands it (is_causal, the dense mask); its
cuDNN calls are checked compiled for an H100 (tests/test_audit.py, tests/test_preset_audit.py).
Grids stay tiny: an interpreted grid step costs ~9 ms and a Mosaic kernel far more. Kernel
pairs run at their shipped tiles (default_config), except grid kernels, at 32 x 32 tiles so
that these short sequences still span several.

Tolerances (error = max |x - ref| / max |ref| per tensor, ref in float32 from the same
rounded inputs): bfloat16 has unit roundoff u = 2^-8. A backend rounds P (dS in the backward)
to bf16 before its second matmul, each term off by at most u relative to its own size, and
rounds its result once more: about 2u of the largest term; the terms (values, keys, dO) of
these unit-normal inputs are at most ~2x the largest output, so 5u bounds it (float16 the
same with its u = 2^-11). float32:
u = 2^-24 over sums of at most ~200 terms, with exp2/log2 rescaling: 2e-5 (~300u).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import (
    BACKENDS,
    FlashConfig,
    attention_reference,
    flash_attention,
)

pytestmark = pytest.mark.mosaic_interpret  # Mosaic warpgroups run in the interpreter

TOL = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 5 * 2.0 ** -8,
       jnp.dtype(jnp.float16): 5 * 2.0 ** -11}
GRID_TILES = FlashConfig(block_q=32, block_kv=32, block_q_bwd=32, block_kv_bwd=32)


# `duplicates` pairs these fields with other frozen dataclasses' (FlashConfig,
# perf/tp_overlap.py, plan/efficiencies.py): named defaults alike in shape only, no logic to
# share.
@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 1
    S: int = 100
    H: int = 2
    N: int = 1
    K: int = 64
    T: int | None = None  # keys; None: S
    causal: bool = True
    segments: bool = False  # packed documents, boundaries off the tile grid
    q_offset: int = 0  # decoding: queries at q_offset.. of a cache of T slots
    kv_valid_len: int | None = None
    dtype: str = "bfloat16"


CASES = {
    "causal_gqa_tail": Case(S=140),  # 2-3 query tiles, 2 key tiles, tails, G = 2
    "noncausal_documents_hd256": Case(S=90, K=256, causal=False, segments=True),
    "causal_documents_hd128": Case(S=100, K=128, segments=True),
    "more_keys_than_queries": Case(S=64, T=150),  # key tiles past every query: dK, dV = 0
    "decoding": Case(S=3, T=40, q_offset=10, kv_valid_len=13, H=4, N=2),
    "float32_batch_kv_heads": Case(B=2, S=40, H=4, N=2, segments=True, dtype="float32"),
}


def _packed(B, S):
    cuts = np.array([S // 5, S // 2 + 3])
    ids = np.searchsorted(cuts, np.arange(S), side="right")
    return jnp.asarray(np.broadcast_to(ids, (B, S)), jnp.int32)


def _inputs(c: Case, seed=0):
    T = c.S if c.T is None else c.T
    ks = jax.random.split(jax.random.key(seed), 4)
    shapes = ((c.B, c.S, c.H, c.K), (c.B, T, c.N, c.K), (c.B, T, c.N, c.K), (c.B, c.S, c.H, c.K))
    return [jax.random.normal(k, s, jnp.float32).astype(c.dtype) for k, s in zip(ks, shapes)]


def _rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(x))
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def _reference(q, k, v, c: Case, seg):
    """The reference with decoding written out: a query at position s + q_offset sees the
    written cache slots up to itself."""
    if not (c.q_offset or c.kv_valid_len is not None):
        return attention_reference(q, k, v, causal=c.causal, segment_ids=seg)
    T = k.shape[1]
    visible = np.arange(T)[None] <= np.arange(c.S)[:, None] + c.q_offset
    visible &= np.arange(T)[None] < (T if c.kv_valid_len is None else c.kv_valid_len)
    rows = [attention_reference(q[:, s:s + 1], k[:, visible[s]], v[:, visible[s]],
                                causal=False) for s in range(c.S)]
    return jnp.concatenate(rows, axis=1)


def _value_and_vjp(f, q, k, v, do):
    """(out, dq, dk, dv) of f in one jitted call (eager ops would each compile)."""
    def both(q, k, v, do):
        out, vjp = jax.vjp(f, q, k, v)
        return (out, *vjp(do.astype(out.dtype)))
    return jax.jit(both)(q, k, v, do)


def check_backend(name: str, case: str, *, cases=None, config=None, grads=True) -> None:
    """One case (of `cases`, default CASES) on one table entry: values and, with grads,
    gradients against the reference; config: the kernel's, instead of the suite's."""
    c, b = (CASES if cases is None else cases)[case], BACKENDS[name]
    why = b.unsupported(c.dtype, c.K)
    if why:
        pytest.skip(why)
    q, k, v, do = _inputs(c)
    seg = _packed(c.B, c.S) if c.segments else None
    if config is None:
        config = GRID_TILES if b.is_kernel and not b.mosaic else None
    run = lambda q, k, v: flash_attention(
        q, k, v, causal=c.causal, segment_ids=seg, q_offset=c.q_offset,
        kv_valid_len=c.kv_valid_len, impl=name, config=config, interpret=b.is_kernel)
    ref = lambda q, k, v: _reference(*(x.astype(jnp.float32) for x in (q, k, v)), c, seg)
    if grads:
        got, want = _value_and_vjp(run, q, k, v, do), _value_and_vjp(ref, q, k, v, do)
    else:  # values only
        got, want = (jax.jit(run)(q, k, v),), (jax.jit(ref)(q, k, v),)
    assert got[0].shape == q.shape and got[0].dtype == q.dtype
    tol = TOL[jnp.dtype(c.dtype)]
    for what, x, r in zip(("out", "dq", "dk", "dv"), got, want):
        err = _rel_err(x, r)
        assert err < tol, f"{name} {case} {what}: relative error {err:.2e} >= {tol:.2e}"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", list(BACKENDS))
def test_backend_matches_reference(name, case):
    check_backend(name, case)


# The sm90 forward with FlashConfig.fwd_overlap (kernel_sm90.py: FA3's intra-warpgroup
# overlap, scale folded into exp2): head dims 64/128/256, causal and not, packed documents,
# GQA, padded lengths (S and T off the tile grid), fp16; values (the backward reads the same
# log-sum-exp: one case checks gradients through it). hd256 with documents keeps the
# non-overlapped loop (registers), so it is the fallback's check.
OVERLAP_CASES = {
    "causal_gqa_tail_hd64": Case(S=140),
    "noncausal_documents_hd64": Case(S=150, causal=False, segments=True),
    "causal_documents_hd128": Case(S=100, K=128, segments=True),
    "noncausal_fp16_hd128": Case(S=200, K=128, H=4, N=2, causal=False, dtype="float16"),
    "causal_hd256": Case(S=140, K=256),
    "noncausal_documents_hd256": Case(S=90, K=256, causal=False, segments=True),
}


@pytest.mark.parametrize("case", list(OVERLAP_CASES))
def test_sm90_fwd_overlap_matches_reference(case):
    from pallas_kernels.flash_attention import default_config
    c = OVERLAP_CASES[case]
    cfg = dataclasses.replace(default_config("mosaic_sm90", c.K), fwd_overlap=True)
    check_backend("mosaic_sm90", case, cases=OVERLAP_CASES, config=cfg,
                  grads=case == "causal_gqa_tail_hd64")


# The sm90 forward with FlashConfig.fwd_persistent on 3 CTAs: each walks several output tiles
# (a ragged split: 16 tiles over 3 CTAs in the batch case), so the K/V ring, its barriers and
# the output staging carry from one tile to the next; causal (longest first), documents, GQA,
# batch 2, padded lengths, hd256 (without fwd_overlap: with it hd256 runs the grid form,
# kernel_sm90.PERSISTENT_OVERLAP_MAX_HEAD_DIM), with and without fwd_overlap: values, and the
# log-sum-exp the backward reads equal to the grid form's.
PERSISTENT_CASES = {
    "causal_gqa_batch_tail_hd64": (Case(B=2, S=230, H=4, N=2), False),
    "causal_documents_batch_hd64_overlap": (Case(B=2, S=200, H=2, segments=True), True),
    "noncausal_documents_hd128": (Case(S=150, K=128, H=4, N=2, causal=False, segments=True),
                                  False),
    "causal_fp16_hd256": (Case(S=140, K=256, H=4, dtype="float16"), False),
}


@pytest.mark.parametrize("case", list(PERSISTENT_CASES))
def test_sm90_fwd_persistent_matches_reference(case):
    from pallas_kernels.flash_attention import default_config
    c, overlap = PERSISTENT_CASES[case]
    cfg = dataclasses.replace(default_config("mosaic_sm90", c.K), fwd_persistent=True,
                              persistent_ctas=3, fwd_overlap=overlap)
    check_backend("mosaic_sm90", case, cases={k: v[0] for k, v in PERSISTENT_CASES.items()},
                  config=cfg, grads=False)


def test_sm90_fwd_persistent_equals_the_grid_form_bit_for_bit():
    """Each tile is the grid form's program: outputs and the log-sum-exp the backward reads
    are the same bits (the backward kernels are the grid form's own)."""
    from pallas_kernels.flash_attention import default_config, flash_attention_fwd
    c = PERSISTENT_CASES["causal_gqa_batch_tail_hd64"][0]
    q, k, v, _ = _inputs(c)
    grid = default_config("mosaic_sm90", c.K)
    runs = [jax.jit(lambda q, k, v, cfg=cfg: flash_attention_fwd(
        q, k, v, causal=True, impl="mosaic_sm90", config=cfg, interpret=True))(q, k, v)
            for cfg in (grid, dataclasses.replace(grid, fwd_persistent=True, persistent_ctas=3))]
    for a, b in zip(*runs):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# The sm100 forward with FlashConfig.fwd_q_tiles=2 (kernel_sm100.py: FA4's two 128-row query
# tiles per CTA, a softmax warpgroup each; block_kv 64 for TMEM): causal with two CTAs per head
# and K/V ring reuse, packed documents (a CTA whose second tile is all padding: an empty own
# range), GQA, batch 2, non-causal, head dims 64 and 128, fp16; values, and gradients through
# the log-sum-exp it saves where the tiles' ranges differ.
Q_TILES_CASES = {
    "causal_gqa_long_hd64": (Case(S=400, H=2, N=1), True),
    "causal_documents_batch_hd64": (Case(B=2, S=100, H=4, N=2, segments=True), True),
    "noncausal_documents_hd64": (Case(S=300, causal=False, segments=True), False),
    "noncausal_fp16_hd128": (Case(S=200, K=128, H=2, causal=False, dtype="float16"), False),
}  # (causal documents at head_dim 128 with two tiles: EXP2_CASES below)


@pytest.mark.parametrize("case", list(Q_TILES_CASES))
def test_sm100_fwd_q_tiles_matches_reference(case):
    from pallas_kernels.flash_attention import default_config
    c, grads = Q_TILES_CASES[case]
    cfg = dataclasses.replace(default_config("mosaic_sm100", c.K), fwd_q_tiles=2, block_kv=64)
    check_backend("mosaic_sm100", case, cases={k: v[0] for k, v in Q_TILES_CASES.items()},
                  config=cfg, grads=grads)


# The sm100 forward with FlashConfig.fwd_exp2_fma (kernel_sm100.exp2_fma: FA4's exp2 on the
# FMA units for some of each tile's 32-score slices): one and two tiles per CTA, documents;
# values and gradients (the backward recomputes P with the hardware exp2 from the saved
# log-sum-exp, which the polynomial's 7.5e-5 shifts far below the bf16 tolerance).
EXP2_CASES = {
    "causal_gqa_tail_hd64": (Case(S=200, H=2, N=1), 1),
    "causal_documents_q_tiles_hd128": (Case(S=300, K=128, segments=True), 2),
}


@pytest.mark.parametrize("case", list(EXP2_CASES))
def test_sm100_fwd_exp2_fma_matches_reference(case):
    from pallas_kernels.flash_attention import default_config
    c, q_tiles = EXP2_CASES[case]
    cfg = dataclasses.replace(default_config("mosaic_sm100", c.K), fwd_exp2_fma=True,
                              fwd_q_tiles=q_tiles, block_kv=128 // q_tiles)
    check_backend("mosaic_sm100", case, cases={k: v[0] for k, v in EXP2_CASES.items()},
                  config=cfg)


# The sm100 forward with P in TMEM (FlashConfig.fwd_p_tmem: the P V MMA reads P from two TMEM
# buffers) and with FA4's correction warpgroup (fwd_correction: the O rescale off the softmax,
# skipped unless a row's max grew by more than log2(256)): 3+ key tiles per query tile (both P
# buffers and both factor buffers reused), causal, GQA, padded lengths, packed documents (rows
# whose first tile is all masked: their first rescale is by 0), batch 2, non-causal fp16, head
# dims 64 and 128; values and gradients through the saved log-sum-exp. (correction, grads)
P_TMEM_CASES = {
    "causal_gqa_tail_hd64": (Case(S=300, H=2, N=1), False, True),
    "causal_gqa_tail_hd64_correction": (Case(S=300, H=2, N=1), True, True),
    "causal_documents_batch_hd128_correction": (Case(B=2, S=400, K=128, H=2, N=1,
                                                     segments=True), True, True),
    "noncausal_documents_hd128": (Case(S=300, K=128, causal=False, segments=True), False, False),
    "noncausal_fp16_hd64_correction": (Case(S=300, causal=False, dtype="float16"), True, False),
}


@pytest.mark.parametrize("case", list(P_TMEM_CASES))
def test_sm100_fwd_p_tmem_matches_reference(case):
    from pallas_kernels.flash_attention import default_config
    c, corr, grads = P_TMEM_CASES[case]
    cfg = dataclasses.replace(default_config("mosaic_sm100", c.K), fwd_p_tmem=True,
                              fwd_correction=corr)
    check_backend("mosaic_sm100", case, cases={k: v[0] for k, v in P_TMEM_CASES.items()},
                  config=cfg, grads=grads)


def test_sm100_fwd_correction_rescales_when_the_max_moves():
    """The correction warpgroup's two branches: keys growing along the sequence (a ramp
    added to K, queries scaled up) move every row's max by more than 8 (log2 units) at later
    key tiles, so O is rescaled there, while small moves keep the stale max (P up to 256);
    values and the log-sum-exp the backward reads match the shipped forward's."""
    from pallas_kernels.flash_attention import default_config, flash_attention_fwd
    S, K = 400, 64
    ks = jax.random.split(jax.random.key(1), 3)
    q = (4.0 * jax.random.normal(ks[0], (1, S, 2, K))).astype(jnp.bfloat16)
    k = (jax.random.normal(ks[1], (1, S, 1, K))
         + jnp.linspace(0.0, 1.0, S)[None, :, None, None]).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (1, S, 1, K)).astype(jnp.bfloat16)
    base = default_config("mosaic_sm100", K)
    runs = [jax.jit(lambda q, k, v, cfg=cfg: flash_attention_fwd(
        q, k, v, causal=True, impl="mosaic_sm100", config=cfg, interpret=True))(q, k, v)
            for cfg in (base, dataclasses.replace(base, fwd_p_tmem=True, fwd_correction=True))]
    (o0, lse0), (o1, lse1) = runs
    ref = attention_reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=True)
    assert _rel_err(o1, ref) < TOL[jnp.dtype(jnp.bfloat16)]
    assert _rel_err(o1, o0) < TOL[jnp.dtype(jnp.bfloat16)]
    np.testing.assert_allclose(np.asarray(lse1), np.asarray(lse0), rtol=1e-5, atol=1e-3)
    # the inputs do what the docstring says: some row's max grows by more than 8 in log2
    # units from one 128-key tile to a later one (the rescale branch), and most rows' maxes
    # move by less between neighbouring tiles (the skip)
    s = np.einsum("bqhd,bkd->bhqk", np.asarray(q, np.float32),
                  np.asarray(k, np.float32)[:, :, 0]) * K ** -0.5 * np.log2(np.e)
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    run_max = np.maximum.accumulate(np.stack([s[..., j:j + 128].max(-1)
                                              for j in range(0, S, 128)], -1), axis=-1)
    moves = np.diff(run_max[..., 2:, :], axis=-1)  # rows 2.. see every tile from the first
    assert (moves > 8).any() and (moves <= 8).mean() > 0.5, (moves > 8).mean()


# The fused backward (FlashConfig.bwd_fused): sm90's (kernel_sm90_bwd_fused.py: FA3's one
# kernel, dQ added per CTA; the shipped sm90 backward at head_dim <= 128, so CASES above run
# it too) and sm100's: GQA, causal and not, packed documents, padded lengths, keys past every
# query, fp16; head_dim 64 and 128 (both FUSED_MAX_HEAD_DIM lets it run at). sm90 skips the
# cases equal to one of CASES (test_backend_matches_reference ran them at the shipped config).
FUSED_CASES = {
    "causal_gqa_tail_hd64": Case(S=140),
    "noncausal_documents_hd64": Case(S=150, causal=False, segments=True),
    "more_keys_than_queries_hd64": Case(S=64, T=150),
    "causal_documents_batch_hd64": Case(B=2, S=100, H=4, N=2, segments=True),
    "causal_documents_hd128": Case(S=100, K=128, segments=True),
    "noncausal_fp16_hd128": Case(S=200, K=128, H=4, N=2, causal=False, dtype="float16"),
}


_FUSED_RUNS = [(impl, module, case) for impl, module in (("mosaic_sm90", "kernel_sm90_bwd"),
                                                          ("mosaic_sm100", "kernel_sm100_bwd"))
               for case, c in FUSED_CASES.items()
               if impl != "mosaic_sm90" or c not in CASES.values()]


@pytest.mark.parametrize("impl,module,case", _FUSED_RUNS)
def test_bwd_fused_matches_reference(impl, module, case, monkeypatch):
    """Both generations' fused backward: sm90's FA3 kernel (kernel_sm90_bwd_fused.py) and
    sm100's (kernel_sm100_bwd.fused_bwd: the dkv kernel plus an M = 64 tcgen05 dQ_t = dS_t K
    per tile, drained by a fourth warpgroup)."""
    import importlib

    from pallas_kernels.flash_attention import default_config
    mod = importlib.import_module(f"pallas_kernels.flash_attention.{module}")
    c = FUSED_CASES[case]
    ran = []
    monkeypatch.setattr(mod, "fused_bwd",
                        lambda *a, f=mod.fused_bwd, **k: ran.append(1) or f(*a, **k))
    cfg = dataclasses.replace(default_config(impl, c.K), bwd_fused=True)
    check_backend(impl, case, cases=FUSED_CASES, config=cfg)
    assert ran, "the fused backward did not run"


# The sm90 dq and dkv kernels (kernel_sm90_bwd.mosaic_bwd, FA2's split): the shipped backward
# before bwd_fused became the default at head_dim <= 128, kept as its A/B alternative
# (gpu_check's sm90_bwd_fused rows): the cases of CASES whose backward is a Mosaic kernel (not
# fp32, head_dim <= 128, no decoding mask: those take the reference, backends.GENERAL).
SPLIT_CASES = {name: c for name, c in CASES.items()
               if c.K <= 128 and c.dtype != "float32" and not c.q_offset
               and c.kv_valid_len is None}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_sm90_split_bwd_matches_reference(case, monkeypatch):
    from pallas_kernels.flash_attention import default_config, kernel_sm90_bwd
    c = SPLIT_CASES[case]
    ran = []
    monkeypatch.setattr(kernel_sm90_bwd, "mosaic_bwd",
                        lambda *a, f=kernel_sm90_bwd.mosaic_bwd, **k: ran.append(1) or f(*a, **k))
    cfg = dataclasses.replace(default_config("mosaic_sm90", c.K), bwd_fused=False)
    check_backend("mosaic_sm90", case, cases=SPLIT_CASES, config=cfg)
    assert ran, "the dq and dkv kernels did not run"


NEW_BACKEND = '''
import jax, jax.numpy as jnp

def attention(q, k, v, mask, *, softmax_scale, impl, config, interpret):
    G = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), G, axis=2) for x in (k, v))
    s = jnp.einsum("bshk,bthk->bhst", q.astype(jnp.float32), k) * softmax_scale
    s = jnp.where(mask.dense(q.shape[1], k.shape[1]), s, -1e30)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhst,bthk->bshk", p, v).astype(q.dtype)
'''


def test_a_new_backend_is_one_file_and_one_entry(tmp_path, monkeypatch):
    """A backend written as docs/attention.md says (one file, one entry) runs through the
    entry point and passes this suite with no other edit (titanax.ops.attention reaches it
    through the same entry point and table)."""
    from pallas_kernels.flash_attention.backends import Backend
    (tmp_path / "my_attention_backend.py").write_text(NEW_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(BACKENDS, "mine", Backend("mine", "softmax in jnp",
                                                  run="my_attention_backend:attention"))
    for case in ("decoding", "float32_batch_kv_heads"):
        check_backend("mine", case)


@pytest.mark.parametrize("case", list(CASES))
def test_reference_is_softmax_attention(case):
    """The reference itself against softmax(q k^T / sqrt(K)) v in float64, written out."""
    c = CASES[case]
    q, k, v, _ = (np.asarray(x, np.float64) for x in _inputs(c))
    seg = _packed(c.B, c.S) if c.segments else None
    T, G = k.shape[1], c.H // c.N
    s = np.einsum("bshk,bthk->bhst", q, np.repeat(k, G, axis=2)) / np.sqrt(c.K)
    pos = np.arange(c.S)[:, None] + c.q_offset
    ok = np.ones((c.S, T), bool)[None]
    if c.causal:
        ok = ok & (np.arange(T)[None] <= pos)
    if c.kv_valid_len is not None:
        ok = ok & (np.arange(T)[None] < c.kv_valid_len)
    if seg is not None:
        ok = ok & (np.asarray(seg)[:, :, None] == np.asarray(seg)[:, None, :])
    s = np.where(ok[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhst,bthk->bshk", p / p.sum(-1, keepdims=True), np.repeat(v, G, axis=2))
    got = jax.jit(_reference, static_argnums=3)(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), c, seg)
    assert _rel_err(got, want) < 1e-5
