"""Context parallelism (parallel/context.py) on 8 simulated devices: the sequence split over
mesh.context 2 and 4, alone and with fsdp, tensor and pipeline, gives one device's loss and
gradients (float32, 1e-5 relative) with and without packed documents, by ring and by
all-gather, through the jnp blocks and the Triton kernel (interpreted); the load-balanced order
and the block attention are checked on their own, and bad layouts fail clearly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import aot
from pallas_kernels.flash_attention import attention_reference
from pallas_kernels.flash_attention.api import flash_block_bwd, flash_block_fwd
from pallas_kernels.flash_attention.backend_xla import block_reference_bwd, block_reference_fwd
from tests.helpers.layouts import assert_matches, loss_and_grads, tiny_config
from titanax import ops
from titanax.config import ConfigError, MeshConfig
from titanax.parallel.context import balanced, natural
from titanax.parallel.mesh import build_mesh

pytestmark = pytest.mark.usefixtures("devices8")

# Context 2 and 4, each beside another axis (context alone is the special case of these with
# one fewer axis; the Triton test below runs context 4 x data 2).
LAYOUTS = {
    "cp2_fsdp4": {"mesh.data": 1, "mesh.fsdp": 4, "mesh.context": 2},
    "cp4_fsdp2": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 4},
    "cp2_tp2_fsdp2": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 2, "mesh.tensor": 2},
    "cp4_tp2": {"mesh.data": 1, "mesh.context": 4, "mesh.tensor": 2},
    "cp4_fsdp2_all_gather": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 4,
                             "execution.context_strategy": "all_gather"},
    "cp2_tp2_pp2": {"mesh.data": 1, "mesh.context": 2, "mesh.tensor": 2, "mesh.pipeline": 2,
                    "pipeline.microbatches": 2},
}


@pytest.fixture(scope="module")
def one_device():
    """{packed documents?: (loss, grads)} on one device."""
    return {packed: loss_and_grads(tiny_config(**{"mesh.data": 1,
                                                  "data.document_masking": packed}),
                                   jax.devices()[:1])[:2]
            for packed in (True, False)}


# Packed documents (segment ids) with every layout; whole rows with context 4 x tensor 2.
CASES = [(name, True) for name in LAYOUTS] + [("cp4_tp2", False)]


@pytest.mark.parametrize("name, packed", CASES,
                         ids=[f"{n}-{'packed' if p else 'unpacked'}" for n, p in CASES])
def test_layout_matches_one_device(name, packed, one_device):
    cfg = tiny_config(**LAYOUTS[name], **{"data.document_masking": packed})
    loss, grads, jaxpr = loss_and_grads(cfg, jax.devices())
    assert_matches((loss, grads), one_device[packed])
    # K/V really travel: ppermute for the ring, all_gather for the other strategy.
    assert ("all_gather" if "all_gather" in name else "ppermute") in jaxpr


def test_triton_kernel_blocks_match_one_device(one_device):
    """The model with the Triton flash kernel (interpreted) as the ring's blocks."""
    cfg = tiny_config(**{"mesh.data": 2, "mesh.context": 4, "execution.attention_impl": "triton"})
    assert_matches(loss_and_grads(cfg, jax.devices())[:2], one_device[True])


def test_balanced_order_puts_a_start_and_an_end_chunk_on_each_device():
    x = jnp.arange(16)[None]
    y = balanced(x, 4)
    # 8 chunks of 2; device r (a quarter of y) holds chunks r and 7 - r.
    assert y.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                        [6, 7, 8, 9]]
    np.testing.assert_array_equal(natural(y, 4), x)
    z = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(natural(balanced(z, 2), 2), z)


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_blocks_merge_to_attention_and_its_gradient(impl):
    """Two key blocks (one causal, one earlier, as context parallelism cuts them) merged by
    their log-sum-exps, and their backwards from the merged lse, give attention over both."""
    B, S, Hq, Hkv, D = 1, 16, 4, 2, 16
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (B, 2 * S, Hq, D))
    k, v = (jax.random.normal(kk, (B, 2 * S, Hkv, D)) for kk in ks[1:3])
    do = jax.random.normal(ks[3], q.shape)
    seg = jnp.asarray(np.repeat([[1, 2, 2, 3]], 8, axis=1).astype(np.int32))
    if impl == "xla":
        fwd, bwd = block_reference_fwd, block_reference_bwd
    else:
        kw = dict(impl="triton", interpret=True)
        fwd = lambda *a, **k_: flash_block_fwd(*a, **kw, **k_)
        bwd = lambda *a, **k_: flash_block_bwd(*a, **kw, **k_)
    q2, s1, s2 = q[:, S:], seg[:, :S], seg[:, S:]
    o_a, l_a = fwd(q2, k[:, S:], v[:, S:], s2, s2, causal=True)
    o_b, l_b = fwd(q2, k[:, :S], v[:, :S], s2, s1, causal=False)
    lse = jnp.logaddexp(l_a, l_b)
    w = lambda l: jnp.exp(l - lse).transpose(0, 2, 1)[..., None]
    out = o_a * w(l_a) + o_b * w(l_b)
    want, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True,
                                                          segment_ids=seg), q, k, v)
    np.testing.assert_allclose(out, want[:, S:], atol=2e-5)
    dq_a, dk_a, dv_a = bwd(q2, k[:, S:], v[:, S:], s2, s2, out, lse, do[:, S:], causal=True)
    dq_b, dk_b, dv_b = bwd(q2, k[:, :S], v[:, :S], s2, s1, out, lse, do[:, S:], causal=False)
    dq, dk, dv = vjp(jnp.concatenate([jnp.zeros_like(do[:, :S]), do[:, S:]], axis=1))
    np.testing.assert_allclose(dq_a + dq_b, dq[:, S:], atol=5e-5)
    np.testing.assert_allclose(jnp.concatenate([dk_b, dk_a], 1), dk, atol=5e-5)
    np.testing.assert_allclose(jnp.concatenate([dv_b, dv_a], 1), dv, atol=5e-5)


def test_scoring_logits_come_back_in_sequence_order():
    """The model's logits (scoring, eval) under context parallelism are those of one device,
    position by position: the balanced order is undone."""
    from flax import nnx

    from titanax.models.registry import model_spec
    from titanax.parallel.rules import model_context

    cfg = tiny_config(**{"mesh.data": 2, "mesh.context": 4})
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 16)), jnp.int32)
    logits = {}
    for name, mesh_cfg, devices in (("one", MeshConfig(data=1), jax.devices()[:1]),
                                    ("cp", cfg.mesh, jax.devices())):
        mesh = build_mesh(mesh_cfg, devices)
        with model_context(mesh):
            model = model_spec(cfg.model).build(cfg.model, cfg.execution, rngs=nnx.Rngs(0))
            logits[name] = np.asarray(jax.jit(lambda m, t: m(t)[0])(model, tokens))
    np.testing.assert_allclose(logits["cp"], logits["one"], rtol=0,
                               atol=1e-5 * np.abs(logits["one"]).max())


def test_mesh_puts_context_inside_the_domain_after_tensor():
    mesh = build_mesh(MeshConfig(data=1, fsdp=2, context=2, tensor=2, nvlink_domain=4))
    ids = np.vectorize(lambda d: d.id)(mesh.devices)  # [pipeline, data, fsdp, context, tensor]
    domain = ids // 4
    assert (domain == domain[:, :, :, :1, :1]).all()  # tensor x context share a domain
    assert (domain[0, 0, 0] != domain[0, 0, 1]).all()  # fsdp crosses domains


@pytest.mark.parametrize("over, words", [
    ({"mesh.context": 4, "train.seq_len": 12}, ["train.seq_len", "multiple of 8"]),
    ({"mesh.context": 2, "mesh.tensor": 4, "train.seq_len": 12, "model.n_heads": 4,
      "model.n_kv_heads": 4}, ["train.seq_len", "mesh.tensor=4", "multiple of 8"]),
    ({"mesh.context": 2, "execution.attention_impl": "cudnn"}, ["cudnn", "shard_map"]),
    ({"execution.context_strategy": "allgather"}, ["execution.context_strategy", "all_gather"]),
])
def test_bad_context_layouts_fail_clearly(over, words):
    with pytest.raises(ConfigError) as err:
        tiny_config(**{"mesh.data": 1, **over})
    for w in words:
        assert w in str(err.value)


def test_attention_refuses_non_causal_context_parallelism():
    mesh = build_mesh(MeshConfig(data=4, context=2))
    q = jnp.zeros((4, 16, 2, 8))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="causal"):
        ops.attention(q, q, q, impl="xla", causal=False)


def test_1f1b_with_context_is_refused():
    with pytest.raises(ConfigError, match="gpipe or circular"):
        tiny_config(**{"mesh.data": 1, "mesh.context": 2, "mesh.pipeline": 2,
                       "pipeline.schedule": "1f1b", "pipeline.microbatches": 2})


_GPU_SCRIPT = r"""
import json, sys, jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from titanax import ops
from pallas_kernels import aot
gpu, impl, strategy = sys.argv[1], sys.argv[2], sys.argv[3]
devices = np.array(aot.gpu_topology(gpu, "1x1x8").devices).reshape(1, 1, 1, 2, 4)
mesh = Mesh(devices, ("pipeline", "data", "fsdp", "context", "tensor"),
            axis_types=(AxisType.Auto,) * 5)
spec = NamedSharding(mesh, P(None, "context", "tensor", None))
q = jax.ShapeDtypeStruct((2, 8192, 32, 128), jnp.bfloat16, sharding=spec)
kv = jax.ShapeDtypeStruct((2, 8192, 8, 128), jnp.bfloat16, sharding=spec)
seg = jax.ShapeDtypeStruct((2, 8192), jnp.int32, sharding=NamedSharding(mesh, P(None, "context")))
loss = lambda q, k, v, s: ops.attention(q, k, v, impl=impl, segment_ids=s,
                                        context_strategy=strategy).astype(jnp.float32).sum()
with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile().as_text()
calls = [l for l in text.splitlines() if "mosaic_gpu" in l and "custom-call" in l]
res = {"calls": len(calls), "local": all("8192" not in l and ",8,128]" in l for l in calls),
       "permutes": text.count("collective-permute-start"),
       "gathers": text.count("all-gather-start"), "scatters": text.count("reduce-scatter")}
print("RESULT" + json.dumps(res))
"""


@pytest.mark.skipif(not aot.plugin_available(), reason="CUDA plugin not installed in "
                    ".venv/cuda-plugin (bash scripts/dev.sh cuda-plugin installs it)")
# One strategy per GPU (the strategies' collectives do not depend on the chip, the kernels
# do): each Mosaic kernel generation compiled once in CI.
@pytest.mark.parametrize("gpu, impl, strategy", [("h100", "mosaic_sm90", "all_gather"),
                                                 ("b200", "mosaic_sm100", "ring")])
def test_mosaic_kernels_compile_as_ring_blocks_on_local_shards(gpu, impl, strategy):
    """Deviceless compile, 8 GPUs as context 2 x tensor 4, 8,192 tokens with packed documents:
    our Mosaic kernels (forward, dq, dk/dv, own block and both remote shapes) run on each
    device's 4,096 tokens and 8 q heads; the ring passes K/V by collective-permute and gathers
    nothing, the all-gather strategy gathers once and reduce-scatters the gradients."""
    import json
    proc = aot.run_script(_GPU_SCRIPT, gpu, impl, strategy, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT"):])
    assert res["local"] and res["calls"] >= 6, res
    if strategy == "ring":
        assert res["permutes"] > 0 and res["gathers"] == 0, res
    else:
        assert res["gathers"] > 0 and res["scatters"] > 0 and res["permutes"] == 0, res


def test_checkpoint_restores_across_context_layouts(tmp_path):
    """Saved with fsdp 8, restored with context 4 x fsdp 2 (parameters then split over fsdp x
    context) and back: the same values, each leaf in the new layout's sharding."""
    from tests.helpers.restore import restore_through
    from tests.helpers.small import small_config

    cfgs = [small_config(**{"mesh.data": 1, "mesh.fsdp": 8}),
            small_config(**{"mesh.data": 1, "mesh.fsdp": 2, "mesh.context": 4}),
            small_config(**{"mesh.data": 2, "mesh.context": 2, "mesh.tensor": 2})]
    for _, state in restore_through(tmp_path, cfgs):
        # the parameters really are split over 'context' in the new layouts
        specs = [leaf.sharding.spec for leaf in jax.tree.leaves(state)]
        assert any("context" in str(spec) for spec in specs)
