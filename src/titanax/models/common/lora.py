"""LoRA adapters on the common block's projections (docs/lora.md): for a weight W used as
einsum(x, W, spec), A [layers, in..., r] and B [layers, r, out...], and the projection becomes
x W + (alpha / r) (x A) B.

The adapters are their own Variable type, LoRA, not an nnx.Param: the train state splits the
model by type (train/state.py), keeps the frozen base in state['params'] and the adapters in
state['lora'], and gives only the latter gradients and optimizer state.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

# Folded into the params stream's key for the adapters' initialisation: the adapters draw no
# key from that stream, so every base weight gets the key it gets without LoRA.
_LORA_STREAM = 0x10A


class LoRA(nnx.Variable):
    """A low-rank adapter factor (A or B) of one block weight, stacked [layers, ...], stored
    float32. Split out of the model by type, like ops.Fp8Meta: the optimizer's only
    parameters when lora.rank > 0."""

    # Real gradients (not fp8_delayed's histories carried as gradients): the pipeline sums
    # them over its ticks like a weight's (parallel/pipeline.py _is_history).
    trained = True


def einsum_roles(spec: str) -> tuple[str, str, str, str]:
    """(x letters, weight letters, output letters, the weight's input letters) of a
    projection spec 'x,w->out' (weight letters without the leading layer axis)."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    return x, w, out, "".join(c for c in w if c in x)


def adapter_shapes(w_shape, spec: str, rank: int) -> tuple[tuple, tuple, list, list]:
    """(A's shape, B's shape, A's positions in W, B's positions in W) for W [layers, ...]:
    A takes W's input axes then the rank, B the rank then W's output axes (each in the order
    of the spec's x and output operands, so the adapter's einsums need no transposes)."""
    x, w, out, w_in = einsum_roles(spec)
    in_letters = [c for c in x if c in w]
    out_letters = [c for c in out if c in w and c not in w_in]
    a_pos = [1 + w.index(c) for c in in_letters]
    b_pos = [1 + w.index(c) for c in out_letters]
    a_shape = (w_shape[0], *(w_shape[i] for i in a_pos), rank)
    b_shape = (w_shape[0], rank, *(w_shape[i] for i in b_pos))
    return a_shape, b_shape, a_pos, b_pos


def make_adapters(key, w_shape, w_axes: tuple[str, ...], spec: str, rank: int):
    """(A, B) LoRA variables for a weight of shape w_shape [layers, ...] with logical axes
    w_axes. A is kaiming-uniform as PEFT's default (torch's Linear init: U(-1/sqrt(fan_in),
    1/sqrt(fan_in)), fan_in the product of W's input axes), B zeros: the adapter adds nothing
    until trained. Both float32 (the optimizer's master copy)."""
    a_shape, b_shape, a_pos, b_pos = adapter_shapes(w_shape, spec, rank)
    bound = 1.0 / math.sqrt(math.prod(a_shape[1:-1]))
    a = jax.random.uniform(key, a_shape, jnp.float32, -bound, bound)
    a_axes = (w_axes[0], *(w_axes[i] for i in a_pos), "lora_rank")
    b_axes = (w_axes[0], "lora_rank", *(w_axes[i] for i in b_pos))
    return (LoRA(a, out_sharding=a_axes),
            LoRA(jnp.zeros(b_shape, jnp.float32), out_sharding=b_axes))


def adapters_key(rngs: nnx.Rngs):
    """The adapters' own key, derived from the params stream without drawing from it."""
    return jax.random.fold_in(rngs.params.key[...], _LORA_STREAM)


def adapter_delta(x, a, b, spec: str, scale: float, dtype):
    """scale * (x A) B for one layer's A [in..., r] and B [r, out...], in the compute dtype:
    what the adapter adds to einsum(x, W, spec)."""
    x_letters, w, out, w_in = einsum_roles(spec)
    rest = "".join(c for c in x_letters if c not in w)  # batch, sequence
    in_letters = "".join(c for c in x_letters if c in w)
    out_letters = "".join(c for c in out if c in w and c not in w_in)
    r = "r"
    assert r not in spec, spec
    xa = jnp.einsum(f"{x_letters},{in_letters}{r}->{rest}{r}", x.astype(dtype), a.astype(dtype))
    y = jnp.einsum(f"{rest}{r},{r}{out_letters}->{out}", xa, b.astype(dtype))
    return (scale * y).astype(dtype)
