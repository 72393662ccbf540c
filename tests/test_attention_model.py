"""The model through the Pallas flash attention path: execution.attention_impl=triton runs the
kernels in interpret mode on CPU, mosaic_sm90 and mosaic_sm100 run the Hopper and Blackwell
kernels (forward and backward) in the Mosaic GPU interpreter, and each must train like the xla
path (same loss curve) with packed documents (segment ids)."""

import functools
import pathlib

import numpy as np
import pytest

from tests.helpers.small import single_device_step
from titanax.config import ConfigError, apply_overrides, load_config
from titanax.parallel.rules import model_context

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = {"model.d_model": 64, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.ffn_dim": 128, "model.vocab_size": 128, "execution.dtype": "float32",
        "train.batch_size": 2, "train.seq_len": 96, "mesh.data": 1, "optim.lr": 3e-3,
        "optim.warmup_steps": 1}
# The Mosaic kernels take bf16/fp16 and head_dim 64, 128 or 256: 2 q heads of 64, 1 kv head.
MOSAIC_MODEL = (("model.d_model", 128), ("model.n_heads", 2), ("model.n_kv_heads", 1),
                ("execution.dtype", "bfloat16"))


@functools.cache
def _losses(impl, steps=10, extra=()):
    cfg = apply_overrides(load_config(ROOT / "configs" / "tiny.py"),
                          {**TINY, **dict(extra), "execution.attention_impl": impl})
    mesh, state, step = single_device_step(cfg)
    rng = np.random.default_rng(0)
    B, S = cfg.train.batch_size, cfg.train.seq_len
    # Two packed documents per row, the boundary off the kernel's block grid.
    seg = (np.arange(S) >= 37).astype(np.int32)
    pos = np.where(seg == 0, np.arange(S), np.arange(S) - 37).astype(np.int32)
    losses = []
    with model_context(mesh):
        for _ in range(steps):
            toks = rng.integers(0, cfg.model.vocab_size // 4, (B, S + 1)).astype(np.int32)
            batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:],
                     "segment_ids": np.broadcast_to(seg, (B, S)).copy(),
                     "positions": np.broadcast_to(pos, (B, S)).copy()}
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    return np.array(losses)


def test_triton_training_matches_xla_loss_curve():
    xla, triton = _losses("xla"), _losses("triton")
    assert xla[-1] < xla[0] - 0.3  # it trains
    np.testing.assert_allclose(triton, xla, rtol=2e-4)


@pytest.mark.mosaic_interpret
@pytest.mark.parametrize("impl", ["mosaic_sm90", "mosaic_sm100"])
def test_mosaic_training_matches_xla_loss_curve(impl):
    xla = _losses("xla", 4, MOSAIC_MODEL)
    assert xla[-1] < xla[0] - 0.3  # it trains
    np.testing.assert_allclose(_losses(impl, 4, MOSAIC_MODEL), xla, rtol=2e-3)


def test_attention_impl_choices():
    cfg = load_config(ROOT / "configs" / "tiny.py")
    for impl in ("triton", "mosaic_sm90", "auto", "xla", "cudnn"):
        assert apply_overrides(cfg, {"execution.attention_impl": impl}).execution.attention_impl == impl
    with pytest.raises(ConfigError, match="not one of"):
        apply_overrides(cfg, {"execution.attention_impl": "pallas"})
