"""Layers that hold no attention logic: parameters, RMSNorm and rotary embeddings (shared by every
architecture under models/)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def make_param(rngs: nnx.Rngs, shape, names, std, dtype) -> nnx.Param:
    """A normal(0, std) parameter carrying its logical axis names (rules.py maps them)."""
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), out_sharding=names)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, param_dtype, stack: int | None = None,
                 axes: tuple[str, ...] | None = None):
        """stack: a leading [stack] axis (one scale per layer); axes: the scale's logical axis
        names (the model's sharding table), by default ('layers', 'norm') or ('norm',)."""
        shape = (stack, dim) if stack else (dim,)
        names = axes or (("layers", "norm") if stack else ("norm",))
        self.scale = nnx.Param(jnp.ones(shape, param_dtype), out_sharding=names)
        self.eps = eps

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


def rms_norm(x, scale, eps: float):
    """RMSNorm as a pure function (the pipeline's loss head calls it with explicit params).
    Statistics in float32 whatever the compute dtype: bf16 sums of squares lose too much."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: str = "none", factor: float = 8.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_seq_len: int = 8192) -> np.ndarray:
    """Inverse frequencies [head_dim // 2], with Llama 3.1's scaling when scaling='llama3'.

    Llama 3.1: wavelengths longer than original_len / low_freq_factor are stretched by `factor`,
    those shorter than original_len / high_freq_factor are kept, and the band between is a
    linear blend in original_len / wavelength (the same formula transformers uses).
    """
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling == "none":
        return inv_freq.astype(np.float32)
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, blended, scaled).astype(np.float32)


def apply_rope(x_BSHK, positions_BS, inv_freq):
    """Rotates pairs (i, i + K/2): the 'rotate half' layout HF Llama checkpoints use, so
    weights leave and enter titanax without permutation."""
    # angles per position and frequency: [B, S, K/2]
    angles = positions_BS[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x_BSHK.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BSHK.dtype)
