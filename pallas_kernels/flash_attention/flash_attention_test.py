"""The flash attention entry point beyond values: its two halves, fully masked rows, a kernel
config the shipped ones do not use, input validation and what `auto` chooses. Values and
gradients of every backend against the reference: backend_suite_test.py.
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


def test_one_tmem_buffer_with_more_keys_than_queries():
    # One X/Y buffer in TMEM (the shipped configs have two): each tile waits for the last.
    # Causal with T > S: key blocks past every query get no tiles in the dkv kernels, and
    # their dK, dV must come out zero (not uninitialized accumulators).
    cfg = dataclasses.replace(default_config("mosaic_sm100", 64), tmem_buffers_bwd=1)
    _check("mosaic_sm100", cfg, B=1, S=64, T=300, Hq=2, Hkv=1, D=64, dtype=jnp.bfloat16,
           causal=True, segments=False)


def test_exp2_fma_is_exp2_to_its_polynomial_bound():
    """kernel_sm100.exp2_fma (FA4's exp2 emulation) on every float32 step of a dense grid of
    the softmax's range [-126, 0]: relative error within the polynomial's fitted 7.5e-5 (plus
    float32 rounding of its three FMAs, ~3 ulp); below -126 (masked scores) at most 2^-125."""
    from pallas_kernels.flash_attention.kernel_sm100 import exp2_fma
    x = np.concatenate([np.linspace(-125, 0, 1_000_001, dtype=np.float32),
                        np.float32([-0.0, -1e-8, -0.5, -0.49999997, -0.50000006, -1.5])])
    got = np.asarray(jax.jit(exp2_fma)(jnp.asarray(x)), np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float64)) - 1)
    assert rel.max() < 7.5e-5 + 4 * 2.0 ** -24, rel.max()
    tiny = np.asarray(jax.jit(exp2_fma)(jnp.float32([-126.5, -1000, -1e30, -np.inf])))
    assert np.all((tiny >= 0) & (tiny <= 2.0 ** -125)), tiny


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
    with pytest.raises(ValueError, match="fwd_overlap"):
        FlashConfig(fwd_overlap=1)
    with pytest.raises(ValueError, match="bwd_fused"):
        FlashConfig(bwd_fused="yes")
    with pytest.raises(ValueError, match="fwd_persistent"):
        FlashConfig(fwd_persistent=None)
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match="persistent_ctas.*one per SM"):
            FlashConfig(fwd_persistent=True, persistent_ctas=bad)
    # Two X/Y buffers of 128-query tiles and dK, dV at head_dim 128: 768 of 512 TMEM columns.
    over = dataclasses.replace(default_config("mosaic_sm100", 128), block_q_bwd=128,
                               tmem_buffers_bwd=2)
    q2, k2, v2 = (x.astype(jnp.bfloat16) for x in _inputs(1, 128, 2, 2, 128, jnp.float32)[:3])
    loss = lambda q: flash_attention(q, k2, v2, causal=True, impl="mosaic_sm100", config=over,
                                     interpret=True).astype(jnp.float32).sum()
    with pytest.raises(ValueError, match="768 TMEM columns, over 512"):
        jax.eval_shape(jax.grad(loss), q2)
    with pytest.raises(ValueError, match="fwd_q_tiles=3: 1 .* or 2"):
        FlashConfig(fwd_q_tiles=3)
    with pytest.raises(ValueError, match="fwd_exp2_fma=2: use True or False"):
        FlashConfig(fwd_exp2_fma=2)
    # Two query tiles, each with two 128-key score buffers and O: 768 columns.
    two = dataclasses.replace(default_config("mosaic_sm100", 128), fwd_q_tiles=2)
    with pytest.raises(ValueError, match="768 TMEM columns, over 512; use block_kv=64"):
        jax.eval_shape(lambda q: flash_attention(q, k2, v2, causal=True, impl="mosaic_sm100",
                                                 config=two, interpret=True), q2)
    # The fused backward's two dQ tiles (128 columns) leave one X/Y buffer at head_dim 128.
    fused2 = dataclasses.replace(default_config("mosaic_sm100", 128), bwd_fused=True,
                                 tmem_buffers_bwd=2)
    loss = lambda q: flash_attention(q, k2, v2, causal=True, impl="mosaic_sm100", config=fused2,
                                     interpret=True).astype(jnp.float32).sum()
    with pytest.raises(ValueError, match="two dQ tiles need 640 TMEM columns.*tmem_buffers_bwd=1"):
        jax.eval_shape(jax.grad(loss), q2)
    # The shipped backward forms: sm90's fused kernel at head_dim 64 and 128 (the static bound,
    # docs/attention.md; backend_suite_test also runs its split form), the grid kernels at
    # 256; sm100's dq and dkv kernels.
    assert [default_config("mosaic_sm90", d).bwd_fused for d in (64, 128, 256)] == [
        True, True, False]
    assert not any(default_config("mosaic_sm100", d).bwd_fused for d in (64, 128, 256))
    q, k, v, _ = _inputs(1, 8, 4, 2, 64, jnp.float32)
    with pytest.raises(ValueError, match="bf16/fp16"):
        flash_attention(q, k, v, impl="mosaic_sm90")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        flash_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), impl="xla")
    with pytest.raises(ValueError, match="unknown"):
        flash_attention(q, k, v, impl="pallas")
    assert resolve_impl("auto", jnp.bfloat16, 128) == "xla"  # CPU: logged fallback
    assert resolve_impl("auto", jnp.bfloat16, 128, interpret=True) == "triton"


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


def test_auto_never_picks_a_refused_kernel(monkeypatch, caplog):
    """A kernel refused in this process (it failed the run's first-contact check on this GPU)
    is replaced: by cuDNN where cuDNN takes the call (packed documents as its dense mask), by
    the XLA reference inside shard_map or for dtypes cuDNN does not take. Explicit names and
    the other GPU generation stay as they were."""
    from pallas_kernels.flash_attention import resolve
    monkeypatch.setattr(resolve, "target_platform", lambda: "gpu")
    monkeypatch.setattr(resolve, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(resolve, "_REFUSED", {})
    resolve._log_once.cache_clear()
    assert resolve_impl("auto", jnp.bfloat16, 128, segment_ids=True) == "mosaic_sm90"
    resolve.refuse("mosaic_sm90", "dq rel error 0.64 > 0.02")
    assert resolve.refused() == {"mosaic_sm90": "dq rel error 0.64 > 0.02"}
    with caplog.at_level("WARNING"):
        assert resolve_impl("auto", jnp.bfloat16, 128, segment_ids=True) == "cudnn"
        assert resolve_impl("auto", jnp.bfloat16, 128, segment_ids=True) == "cudnn"
        assert resolve_impl("auto", jnp.bfloat16, 128, manual=True) == "xla"
    said = [r.message for r in caplog.records if "refused" in r.message]
    assert len(said) == 2 and "dq rel error 0.64" in said[0] and "'cudnn'" in said[0], said
    assert "shard_map" in said[1] and "'xla'" in said[1], said
    assert resolve_impl("auto", jnp.bfloat16, 128) == "cudnn"  # no documents: cuDNN anyway
    assert resolve_impl("mosaic_sm90", jnp.bfloat16, 128) == "mosaic_sm90"  # explicit
    # The portable kernel (no generation kernel for float32) refused: cuDNN takes no float32.
    resolve.refuse("triton", "crashed: Segmentation fault")
    assert resolve_impl("auto", jnp.float32, 128, segment_ids=True) == "xla"
    monkeypatch.setattr(resolve, "compute_capability", lambda: (10, 0))
    assert resolve_impl("auto", jnp.bfloat16, 128, segment_ids=True) == "mosaic_sm100"
    # Planning ahead (plan=True): what auto picks before any refusal, logging nothing.
    monkeypatch.setattr(resolve, "compute_capability", lambda: (9, 0))
    resolve._log_once.cache_clear()
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert resolve_impl("auto", jnp.bfloat16, 64, segment_ids=True, plan=True) == "mosaic_sm90"
    assert not [r for r in caplog.records if "flash_attention auto" in r.message]
    resolve.clear_refusals()
    assert resolve.refused() == {}
