"""Values and gradients of the Pallas flash attention kernels vs the jnp reference, on CPU.

triton: the grid kernels in Pallas interpret mode. mosaic_sm90 / mosaic_sm100: the Hopper and
Blackwell forward and backward (dq, dkv) kernels in the Mosaic GPU interpreter (SMEM, mbarriers,
TMA, wgmma; tcgen05 and TMEM).
Error = max |x - ref| / max |ref| per tensor: fp32 within 2e-5, bf16 within 2e-2. Cases stay
small (interpret mode costs ~9 ms per grid step) but cover causal and not, GQA 1/4/8, lengths
that are not block multiples, head_dim 64 and 128, packed-document segment ids.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_attention import (
    FlashConfig,
    attention_reference,
    default_config,
    flash_attention,
    flash_attention_bwd,
    flash_attention_fwd,
)
from pallas_kernels.flash_attention.api import resolve_impl

pytestmark = pytest.mark.mosaic_interpret  # warpgroups run in the Mosaic GPU interpreter

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
SMALL = FlashConfig(block_q=32, block_kv=32, block_q_bwd=32, block_kv_bwd=32)


def _inputs(B, S, Hq, Hkv, D, dtype, seed=0, T=None):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    T = S if T is None else T
    q = jax.random.normal(kq, (B, S, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, T, Hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, T, Hkv, D), jnp.float32).astype(dtype)
    do = jax.random.normal(kd, (B, S, Hq, D), jnp.float32).astype(dtype)
    return q, k, v, do


def _packed(B, S):
    """Documents of uneven lengths, boundaries off the block grid."""
    cuts = np.array([S // 5, S // 2 + 3])
    return jnp.asarray(np.broadcast_to(np.searchsorted(cuts, np.arange(S), side="right"), (B, S)),
                       jnp.int32)


def _rel_err(x, ref):
    x, ref = np.asarray(x, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(x))
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def _check(impl, cfg, *, B, S, Hq, Hkv, D, dtype, causal, segments, T=None):
    q, k, v, do = _inputs(B, S, Hq, Hkv, D, dtype, T=T)
    seg = _packed(B, S) if segments else None
    flash = lambda q, k, v: flash_attention(q, k, v, causal=causal, segment_ids=seg, impl=impl,
                                            config=cfg, interpret=True)
    ref = lambda q, k, v: attention_reference(
        *(x.astype(jnp.float32) for x in (q, k, v)), causal=causal, segment_ids=seg)
    out, vjp = jax.vjp(flash, q, k, v)
    out_ref, vjp_ref = jax.vjp(ref, q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    grads, grads_ref = vjp(do), vjp_ref(do.astype(jnp.float32))
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (out_ref, *grads_ref)):
        err = _rel_err(x, r)
        assert err < TOL[dtype], f"{name}: relative error {err:.2e} >= {TOL[dtype]}"


@pytest.mark.parametrize("dtype, causal, G, D, S, segments", [
    (jnp.float32, True, 1, 64, 50, False),
    (jnp.float32, False, 4, 64, 70, True),
    (jnp.float32, True, 8, 128, 45, True),
    (jnp.float32, False, 1, 128, 64, False),
    (jnp.bfloat16, True, 4, 128, 100, False),
    (jnp.bfloat16, False, 8, 64, 33, False),
    (jnp.bfloat16, True, 1, 64, 90, True),
])
def test_triton_matches_reference(dtype, causal, G, D, S, segments):
    _check("triton", SMALL, B=1, S=S, Hq=G if G > 1 else 2, Hkv=1 if G > 1 else 2, D=D,
           dtype=dtype, causal=causal, segments=segments)


def test_triton_batch_and_kv_heads():
    # B=2, 2 kv heads of 4 q heads each: the head -> kv head map and batch indexing.
    _check("triton", SMALL, B=2, S=40, Hq=8, Hkv=2, D=64, dtype=jnp.float32, causal=True,
           segments=True)


# The Mosaic kernels run at the configs we ship (config=None: default_config(impl, head_dim)),
# head dims 64, 128 and 256 (whose backward is the grid kernels'). Segment ids at head dims 64
# and 128 (GQA, tails, drained and skipped tiles, causal and not): tile_skip_test.py.
@pytest.mark.parametrize("causal, G, D, S, segments", [
    (True, 1, 64, 300, False),   # 3 CTAs, 3 kv tiles, diagonal + drained tiles, key tail
    (True, 2, 256, 150, True),
])
def test_mosaic_sm90_interpreted_matches_reference(causal, G, D, S, segments):
    _check("mosaic_sm90", None, B=1, S=S, Hq=G if G > 1 else 2, Hkv=1 if G > 1 else 2, D=D,
           dtype=jnp.bfloat16, causal=causal, segments=segments)


@pytest.mark.parametrize("impl, cfg", [
    ("mosaic_sm90", None),
    # One X/Y buffer in TMEM (the shipped configs have two): each tile waits for the last.
    ("mosaic_sm100", dataclasses.replace(default_config("mosaic_sm100", 64),
                                         tmem_buffers_bwd=1)),
])
def test_mosaic_more_keys_than_queries(impl, cfg):
    # Causal with T > S: key blocks past every query get no tiles in the dkv kernels, and
    # their dK, dV must come out zero (not uninitialized accumulators).
    _check(impl, cfg, B=1, S=64, T=300, Hq=2, Hkv=1, D=64, dtype=jnp.bfloat16, causal=True,
           segments=False)


def test_fwd_and_bwd_halves_are_the_vjp():
    # The public halves (what titanax runs under shard_map) give exactly flash_attention's
    # output and VJP, tails and segments included; they take Pallas impls only.
    q, k, v, do = _inputs(1, 40, 4, 2, 64, jnp.float32)
    seg = _packed(1, 40)
    kw = dict(causal=True, impl="triton", config=SMALL, interpret=True)
    out, vjp = jax.vjp(lambda q, k, v: flash_attention(q, k, v, segment_ids=seg, **kw), q, k, v)
    out2, lse = flash_attention_fwd(q, k, v, seg, **kw)
    np.testing.assert_array_equal(out2, out)
    for g, g2 in zip(vjp(do), flash_attention_bwd(q, k, v, seg, out2, lse, do, **kw)):
        np.testing.assert_array_equal(g2, g)
    with pytest.raises(ValueError, match="Pallas impls"):
        flash_attention_fwd(q, k, v, impl="xla")


def test_fully_masked_padding_rows_stay_finite():
    # A query whose only visible key is itself, in a one-token document at a block boundary.
    q, k, v, _ = _inputs(1, 33, 2, 2, 64, jnp.float32)
    seg = jnp.asarray(np.r_[np.zeros(32), [1]][None], jnp.int32)
    out = flash_attention(q, k, v, causal=True, segment_ids=seg, impl="triton", config=SMALL,
                          interpret=True)
    np.testing.assert_allclose(out[0, 32], v[0, 32], rtol=1e-5)


def test_config_validation_and_dispatch():
    with pytest.raises(ValueError, match="power of two"):
        FlashConfig(block_q=48)
    with pytest.raises(ValueError, match="multiple of 64"):
        FlashConfig(block_q=32).check_mosaic()
    with pytest.raises(ValueError, match="max_concurrent_steps"):
        FlashConfig(max_concurrent_steps=1)
    with pytest.raises(ValueError, match="tmem_buffers_bwd"):
        FlashConfig(tmem_buffers_bwd=3)
    # Two X/Y buffers of 128-query tiles and dK, dV at head_dim 128: 768 of 512 TMEM columns.
    over = dataclasses.replace(default_config("mosaic_sm100", 128), block_q_bwd=128,
                               tmem_buffers_bwd=2)
    q2, k2, v2 = (x.astype(jnp.bfloat16) for x in _inputs(1, 128, 2, 2, 128, jnp.float32)[:3])
    loss = lambda q: flash_attention(q, k2, v2, causal=True, impl="mosaic_sm100", config=over,
                                     interpret=True).astype(jnp.float32).sum()
    with pytest.raises(ValueError, match="768 TMEM columns, over 512"):
        jax.eval_shape(jax.grad(loss), q2)
    q, k, v, _ = _inputs(1, 8, 4, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="bf16/fp16"):
        flash_attention(q, k, v, impl="mosaic_sm90")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), impl="xla")
    with pytest.raises(ValueError, match="unknown"):
        flash_attention(q, k, v, impl="pallas")
    assert resolve_impl("auto", jnp.bfloat16, 128) == "xla"  # CPU: logged fallback
    assert resolve_impl("auto", jnp.bfloat16, 128, interpret=True) == "triton"
    # The xla and cudnn peers agree with the reference on CPU.
    for impl in ("xla", "cudnn"):
        out = flash_attention(q, k, v, causal=True, impl=impl)
        assert _rel_err(out, attention_reference(q, k, v, causal=True)) < 1e-5


@pytest.mark.parametrize("causal, G, D, S, segments", [
    (True, 1, 64, 300, False),   # 3 CTAs, 3 kv tiles: diagonal, skipped tiles, key tail
    # (non-causal GQA with segments: tile_skip_sm100_test.py's context-parallel blocks)
    (True, 8, 128, 200, True),   # packed-document training at the 70B head_dim and grouping
    # head_dim 256 (64-key tiles, grid-kernel backward): tile_skip_sm100_test.py
])
def test_mosaic_sm100_interpreted_matches_reference(causal, G, D, S, segments):
    # Three warpgroups block on mbarriers inside XLA host callbacks: conftest.py widens XLA's
    # CPU thread pool (PJRT_NPROC) so that two waiting ones cannot starve the third.
    _check("mosaic_sm100", None, B=1, S=S, Hq=G if G > 1 else 2, Hkv=1 if G > 1 else 2, D=D,
           dtype=jnp.bfloat16, causal=causal, segments=segments)


@pytest.mark.parametrize("cc, ours", [((9, 0), "mosaic_sm90"), ((10, 0), "mosaic_sm100")])
def test_auto_takes_cudnn_until_a_recorded_benchmark_says_otherwise(monkeypatch, caplog, cc,
                                                                    ours):
    from pallas_kernels import measured
    from pallas_kernels.flash_attention import resolve
    monkeypatch.setattr(resolve, "target_platform", lambda: "gpu")
    monkeypatch.setattr(resolve, "compute_capability", lambda: cc)
    resolve._log_once.cache_clear()
    with caplog.at_level("WARNING"):
        assert resolve_impl("auto", jnp.bfloat16, 128) == "cudnn"
        assert resolve_impl("auto", jnp.bfloat16, 128) == "cudnn"
    said = [r.message for r in caplog.records if "flash_attention auto" in r.message]
    assert len(said) == 1 and "'cudnn'" in said[0] and "no benchmark" in said[0], said
    # cuDNN cannot take packed documents nor run inside shard_map: ours, with the reason.
    assert resolve_impl("auto", jnp.bfloat16, 128, segment_ids=True) == ours
    assert resolve_impl("auto", jnp.bfloat16, 128, manual=True) == ours
    assert any("segment ids" in r.message for r in caplog.records)
    # No kernel of ours for these inputs: triton where cuDNN cannot go, cuDNN elsewhere.
    assert resolve_impl("auto", jnp.float32, 128, segment_ids=True) == "triton"
    assert resolve_impl("auto", jnp.float32, 128) == "cudnn"
    # A win recorded for this GPU generation makes ours the default there, and only there.
    monkeypatch.setitem(measured.WINS, ("attention", cc[0]), ours)
    assert resolve_impl("auto", jnp.bfloat16, 128) == ours
    monkeypatch.setattr(resolve, "compute_capability", lambda: (cc[0] + 2, 0))
    assert resolve_impl("auto", jnp.bfloat16, 128) == "cudnn"
    # An explicit impl is never second-guessed.
    assert resolve_impl(ours, jnp.bfloat16, 128) == ours
