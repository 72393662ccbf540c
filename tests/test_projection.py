"""models/common/linear.py: the block's projections are modules (weight, spec, TP role, FP8
histories, LoRA adapters) stored flat, so the block's nnx.State has the paths it had when they
were bare attributes (wq, fp8_wq, wq_lora_a, ...); split/merge and update keep the modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.helpers.layouts import tiny_config
from titanax import ops
from titanax.models.common.block import BlockOptions, DecoderBlock
from titanax.models.common.linear import Projection
from titanax.models.common.lora import LoRA, adapter_delta, dropout_context, dropout_input
from titanax.models.common.sharding import decoder_axes
from titanax.parallel.mesh import single_device_mesh
from titanax.parallel.rules import model_context

_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def _block(**over) -> tuple:
    """(the run config, its DecoderBlock)."""
    cfg = tiny_config(**{"model.n_layers": 2, **over})
    lora = cfg.lora if cfg.lora.enabled else None
    with model_context(single_device_mesh()):
        return cfg, DecoderBlock(cfg.model, cfg.execution, BlockOptions(), decoder_axes(),
                                 rngs=nnx.Rngs(0), lora=lora)


def test_state_paths_are_the_flat_names():
    cfg, block = _block(**{"lora.rank": 2, "execution.matmul_precision": "fp8_delayed"})
    _, params, lora, fp8 = nnx.split(block, nnx.Param, LoRA, ops.Fp8Meta)
    assert set(params) == {*_NAMES, "attn_norm", "mlp_norm"}
    assert set(fp8) == {f"fp8_{n}" for n in _NAMES}
    assert set(lora) == {f"{n}_lora_{ab}" for n in cfg.lora.weights for ab in "ab"}
    assert isinstance(block.wq, Projection) and block.wq.kernel[...].shape == params["wq"].shape


def test_merge_and_update_keep_the_modules():
    _, block = _block(**{"lora.rank": 2, "execution.matmul_precision": "fp8_delayed"})
    graphdef, state = nnx.split(block)
    merged = nnx.merge(graphdef, state)
    assert isinstance(merged.wo, Projection)
    assert (merged.wo.spec, merged.wo.tp) == ("bshk,dhk->bsd", "row")
    assert merged.wq.fp8 is not None and merged.wq.lora_a is not None
    assert jax.tree.structure(nnx.state(merged)) == jax.tree.structure(state)
    wq = merged.wq
    nnx.update(merged, jax.tree.map(jnp.ones_like, state))
    assert merged.wq is wq  # updated in place, the module kept
    for v in (wq.kernel, wq.fp8, wq.lora_a, wq.lora_b):
        assert float(v[...].min()) == float(v[...].max()) == 1.0


def test_projection_is_the_einsum_plus_its_adapter_with_dropout_from_the_context():
    _, block = _block(**{"lora.rank": 2, "lora.dropout": 0.5, "execution.dtype": "float32"})
    one = nnx.merge(*_first_layer(block))
    one.wq.lora_b[...] = jnp.full_like(one.wq.lora_b[...], 0.1)  # a nonzero adapter
    x = jax.random.normal(jax.random.key(1), (2, 3, one.wq.kernel.shape[0]), jnp.float32)
    base = jnp.einsum(one.wq.spec, x, one.wq.kernel[...])
    delta = adapter_delta(x, one.wq.lora_a[...], one.wq.lora_b[...], one.wq.spec,
                          one.wq.lora_scale, jnp.float32)
    np.testing.assert_allclose(one.wq(x), base + delta, rtol=1e-5, atol=1e-6)
    keys = jax.random.key_data(jax.random.split(jax.random.key(2), 6)).reshape(2, 3, 2)
    with dropout_context((keys, 1)):
        dropped = one.wq(x)
    x_in = dropout_input(x, keys, 1, "wq", 0.5)
    want = base + adapter_delta(x_in, one.wq.lora_a[...], one.wq.lora_b[...], one.wq.spec,
                                one.wq.lora_scale, jnp.float32)
    np.testing.assert_allclose(dropped, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(dropped, one.wq(x))  # outside the context: no dropout
    q, _, _ = Projection.shared(x, one.wq, one.wk, one.wv)
    np.testing.assert_allclose(q, one.wq(x), rtol=1e-6)


def _first_layer(block):
    """(graphdef, state) of layer 0 (the stacked state sliced), as the layer scan sees it."""
    graphdef, state = nnx.split(block)
    return graphdef, jax.tree.map(lambda v: v[0], state)
