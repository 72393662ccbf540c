import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from titanax.config import ExecutionConfig, ModelConfig
from titanax.models import model_spec, preset
from titanax.models.common.decoder import init_cache
from titanax.models.common.layers import RMSNorm, apply_rope, rope_inv_freq
from titanax.models.llama3.model import Llama
from titanax.ops import attention
from titanax.parallel.mesh import single_device_mesh
from titanax.parallel.rules import model_context

pytestmark = pytest.mark.usefixtures("devices8")  # meshes over 8 simulated devices

count_params = model_spec("llama3").count_params


@pytest.mark.parametrize("name, expected", [
    ("llama3_8b", 8_030_261_248),
    ("llama3_70b", 70_553_706_496),
    ("llama3_405b", 405_853_388_800),
])
def test_preset_parameter_counts(name, expected):
    assert count_params(preset(name)) == expected


def test_rmsnorm_matches_numpy():
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype(np.float32)
    with model_context(single_device_mesh()):
        norm = RMSNorm(16, eps=1e-5, param_dtype=jnp.float32)
    norm.scale[...] = jnp.linspace(0.5, 1.5, 16)
    expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * np.linspace(0.5, 1.5, 16)
    np.testing.assert_allclose(np.asarray(norm(jnp.asarray(x))), expected, rtol=1e-5, atol=1e-6)


def _numpy_llama3_inv_freq(dim, theta, factor, low, high, orig):
    """Transcribed from Meta's llama-models apply_scaling (a loop, not vectorised)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2)[: dim // 2] / dim))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(f)
        elif wavelen > orig / low:
            out.append(f / factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def test_rope_llama3_scaling_matches_reference_loop():
    got = rope_inv_freq(128, 500000.0, "llama3", 8.0, 1.0, 4.0, 8192)
    want = _numpy_llama3_inv_freq(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # Scaling changes the low frequencies and leaves the highest alone.
    plain = rope_inv_freq(128, 500000.0, "none")
    assert got[0] == pytest.approx(plain[0]) and got[-1] == pytest.approx(plain[-1] / 8.0)


def test_rope_rotation_matches_numpy():
    rng = np.random.default_rng(1)
    B, S, H, D = 2, 7, 3, 8
    x = rng.normal(size=(B, S, H, D)).astype(np.float32)
    pos = rng.integers(0, 100, size=(B, S))
    inv = rope_inv_freq(D, 10000.0)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(pos), inv))
    want = np.empty_like(x)
    for b in range(B):
        for s in range(S):
            for i in range(D // 2):
                a = pos[b, s] * inv[i]
                x1, x2 = x[b, s, :, i], x[b, s, :, i + D // 2]
                want[b, s, :, i] = x1 * np.cos(a) - x2 * np.sin(a)
                want[b, s, :, i + D // 2] = x2 * np.cos(a) + x1 * np.sin(a)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # A rotation keeps norms, and relative positions are all that matter for q.k.
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)


def _naive_attention(q, k, v, causal, segment_ids=None):
    """Repeat K/V heads (the memory-hungry way) and loop over heads."""
    B, S, Hq, D = q.shape
    G = Hq // k.shape[2]
    k, v = np.repeat(k, G, axis=2), np.repeat(v, G, axis=2)
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            s = q[b, :, h] @ k[b, :, h].T / math.sqrt(D)
            allowed = np.ones((S, S), bool)
            if causal:
                allowed &= np.tril(np.ones((S, S), bool))
            if segment_ids is not None:
                allowed &= segment_ids[b][:, None] == segment_ids[b][None, :]
            s = np.where(allowed, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h]
    return out


@pytest.mark.parametrize("impl", ["xla", "cudnn"])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_gqa_attention_matches_naive(impl, hq, hkv, causal):
    rng = np.random.default_rng(hq * 10 + hkv)
    B, S, D = 2, 9, 16
    q = rng.normal(size=(B, S, hq, D)).astype(np.float32)
    k = rng.normal(size=(B, S, hkv, D)).astype(np.float32)
    v = rng.normal(size=(B, S, hkv, D)).astype(np.float32)
    seg = np.array([[1] * 4 + [2] * 5, [1] * 9])
    got = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl=impl, causal=causal,
                    segment_ids=jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(got), _naive_attention(q, k, v, causal, seg),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("seq", [128, 256, 320])  # 2, 4 and 5 causal query chunks
def test_chunked_causal_xla_attention_matches_naive(seq):
    rng = np.random.default_rng(seq)
    q = rng.normal(size=(1, seq, 4, 16)).astype(np.float32)
    k = rng.normal(size=(1, seq, 2, 16)).astype(np.float32)
    v = rng.normal(size=(1, seq, 2, 16)).astype(np.float32)
    seg = np.repeat([1, 2, 3], [seq // 3, seq // 3, seq - 2 * (seq // 3)])[None]
    got = attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), impl="xla", causal=True,
                    segment_ids=jnp.asarray(seg))
    np.testing.assert_allclose(np.asarray(got), _naive_attention(q, k, v, True, seg),
                               rtol=2e-5, atol=2e-5)


def _tiny() -> ModelConfig:
    return preset("tiny", n_layers=2)


F32 = ExecutionConfig(dtype="float32")


def _tiny_llama(execution: ExecutionConfig = F32):
    """(the tiny 2-layer config, its Llama built on one device with seed 0)."""
    cfg = _tiny()
    with model_context(single_device_mesh()):
        return cfg, Llama(cfg, execution, rngs=nnx.Rngs(0))


def test_loss_at_init_is_near_ln_vocab():
    cfg, model = _tiny_llama()
    toks = jax.random.randint(jax.random.key(1), (4, 64), 0, cfg.vocab_size)
    logits, _ = model(toks)
    logp = jax.nn.log_softmax(logits, axis=-1)
    loss = -jnp.take_along_axis(logp[:, :-1], toks[:, 1:, None], axis=-1).mean()
    assert abs(float(loss) - math.log(cfg.vocab_size)) < 0.15


def test_kv_cache_decoding_matches_full_forward():
    cfg, model = _tiny_llama()
    toks = jax.random.randint(jax.random.key(2), (2, 12), 0, cfg.vocab_size)
    full, _ = model(toks)
    cache = init_cache(cfg, 2, 16, "float32")
    pieces = []
    logits, cache = model(toks[:, :5], cache=cache, cache_index=0)  # prefill
    pieces.append(logits)
    for i in range(5, 12):
        logits, cache = model(toks[:, i:i + 1], cache=cache, cache_index=i)
        pieces.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1)), np.asarray(full),
                               rtol=1e-4, atol=1e-4)


def test_segment_ids_isolate_packed_documents():
    """A document's logits do not depend on the document packed before it."""
    cfg, model = _tiny_llama()
    doc = jnp.arange(1, 7)[None]
    packed_a = jnp.concatenate([jnp.full((1, 5), 9), doc], 1)
    packed_b = jnp.concatenate([jnp.full((1, 5), 33), doc], 1)
    seg = jnp.asarray([[1] * 5 + [2] * 6])
    pos = jnp.asarray([list(range(5)) + list(range(6))])
    la, _ = model(packed_a, pos, seg)
    lb, _ = model(packed_b, pos, seg)
    alone, _ = model(doc)
    np.testing.assert_allclose(np.asarray(la[:, 5:]), np.asarray(lb[:, 5:]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(la[:, 5:]), np.asarray(alone), atol=1e-4)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_does_not_change_gradients(remat):
    cfg = _tiny()
    toks = jax.random.randint(jax.random.key(3), (2, 16), 0, cfg.vocab_size)

    def grads(execution):
        g, p = nnx.split(_tiny_llama(execution)[1], nnx.Param)
        return jax.grad(lambda p: nnx.merge(g, p)(toks)[0].mean())(p)

    base, other = grads(F32), grads(ExecutionConfig(dtype="float32", remat=remat))
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(other)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_parameters_carry_logical_axis_names():
    _, model = _tiny_llama()
    assert model.layers.wq.kernel.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")
    assert model.embed.get_metadata()["out_sharding"] == ("vocab", "embed")
    assert model.layers.wq.kernel.shape[0] == 2  # stacked over layers, run with scan
