"""LoRA adapters on the common block's projections (docs/lora.md): for a weight W used as
einsum(x, W, spec), A [layers, in..., r] and B [layers, r, out...], and the projection becomes
x W + (alpha / r) (x A) B. With lora.dropout = p > 0 the train step drops the adapter's input:
x W + (alpha / r) (dropout(x) A) B, inverted (kept values scaled by 1 / (1 - p)), as PEFT does.

The adapters are their own Variable type, LoRA, not an nnx.Param: the train state splits the
model by type (train/roles.py's table): the base is the frozen role, the adapters the adapter
role, and only the adapters get gradients and optimizer state (saved under 'lora' on disk).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx

from titanax.config.lora import LORA_TARGETS

# Folded into the params stream's key for the adapters' initialisation: the adapters draw no
# key from that stream, so every base weight gets the key it gets without LoRA.
_LORA_STREAM = 0x10A
# Folded into key(train.seed) for adapter dropout's masks: a stream of its own.
_DROPOUT_STREAM = 0xD0
# The batch entry the train step adds with lora.dropout > 0: each token's dropout key
# (dropout_token_keys). Split with the batch into microbatches (train.grad_accum,
# pipeline.microbatches) like the tokens; eval and sampling batches have none: no dropout.
DROPOUT_KEYS = "lora_dropout_keys"
# Each projection's fixed number in the masks' hash counter (dropout_keep): every projection
# draws its own mask, as PEFT's dropout module per adapted Linear does, whatever lora.targets
# chooses.
_DROPOUT_SITES = tuple(LORA_TARGETS.values())
# Adapter dropout's inputs while a layer traces (dropout_context): one context variable, so
# no seam of the block passes them along.
_DROPOUT = contextvars.ContextVar("lora_dropout", default=None)


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


def block_arguments(lora) -> dict:
    """The decoder's block_cls keyword for LoRA: {'lora': the section} when lora.rank > 0, else
    none (a block without adapter support, e.g. the MoE one, takes no such argument)."""
    return {"lora": lora} if lora is not None and lora.enabled else {}


def attach_adapters(projections_by_name, lora, axes, rngs: nnx.Rngs) -> None:
    """Adapters on lora.targets' projections (common/linear.py Projection.with_adapters), the
    i-th target's key folded from adapters_key by i; nothing without lora (None or rank 0).
    projections_by_name: weight name -> Projection; axes: weight name -> its logical axes."""
    if lora is None or not lora.enabled:
        return
    key = adapters_key(rngs)
    for i, name in enumerate(lora.weights):
        projections_by_name(name).with_adapters(jax.random.fold_in(key, i), axes[name], lora)


def with_dropout_keys(extras: tuple, keys_BS2, reorder, layer_ids) -> tuple:
    """(extras + the tokens' dropout keys in the run's token order (reorder), the layers'
    logical indices (layer_ids())) when the train step gave keys (lora.dropout > 0), else
    (extras, None): what the decoder's layer scan carries for dropout_context."""
    if keys_BS2 is None:
        return extras, None
    return extras + (reorder(keys_BS2),), layer_ids()


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


def dropout_token_keys(seed: int, step, batch: int, seq: int):
    """uint32 [batch, seq, 2]: each token's adapter-dropout key at train step `step`:
    key(seed) folded with this stream, the step, then the token's index in the step's batch
    (row * seq + position). One key per token, not one per batch, so a token's masks are the
    same whichever microbatch, device or sequence order (context parallelism) it lands in:
    they depend on the seed, the step, the token, the layer and the projection alone."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), _DROPOUT_STREAM), step)
    ids_BS = jnp.arange(batch * seq, dtype=jnp.uint32).reshape(batch, seq)
    per_token = jax.vmap(jax.vmap(lambda i: jax.random.fold_in(key, i)))
    return jax.random.key_data(per_token(ids_BS))


def dropout_keep(keys_BS2, layer, weight: str, feature_shape, rate: float):
    """bool [B, S, *feature_shape]: which inputs of weight `weight`'s adapter in (logical)
    layer `layer` are kept, each with probability 1 - rate, from the tokens' keys
    (dropout_token_keys, or a microbatch's rows of them).

    The Threefry hash jax.random.bits uses, on counters of its own: keyed by the token, the
    counter pair (layer and projection, feature index). One hash per element as for
    jax.random.bits, without a key derived per token and projection first; elementwise, so
    XLA partitions it over any sharding of the tokens and features."""
    site = (jnp.asarray(layer, jnp.uint32) * len(_DROPOUT_SITES)
            + _DROPOUT_SITES.index(weight)).astype(jnp.uint32)
    feature = jnp.arange(math.prod(feature_shape), dtype=jnp.uint32).reshape(feature_shape)
    token = (...,) + (None,) * len(feature_shape)  # the key's words against the features
    bits1, bits2 = jax.extend.random.threefry2x32_p.bind(*jnp.broadcast_arrays(
        keys_BS2[..., 0][token], keys_BS2[..., 1][token], site, feature))
    # kept when the 32 random bits (combined as jax.random.bits combines them) are at or
    # above rate * 2^32: probability 1 - rate, to 2^-32
    return (bits1 ^ bits2) >= jnp.uint32(min(round(rate * 2**32), 2**32 - 1))


def dropout_mask(seed: int, step, layer: int, weight: str, shape, rate: float):
    """The keep mask the train step draws at `step` for weight `weight`'s adapter input of
    `shape` [B, S, ...] (the whole step's batch) in layer `layer`: what a reference applies."""
    return dropout_keep(dropout_token_keys(seed, step, shape[0], shape[1]), layer, weight,
                        shape[2:], rate)


def dropped(x, keep, rate: float):
    """Inverted dropout: x where kept, scaled by 1 / (1 - rate) (so its expectation is x),
    else 0, in x's dtype."""
    return jnp.where(keep, x * (1.0 / (1.0 - rate)), jnp.zeros((), x.dtype))


def dropout_input(x, keys_BS2, layer, weight: str, rate: float):
    """The adapter's input of weight `weight` in a training pass: x [B, S, ...] dropped with
    the tokens' keys (their rows of dropout_token_keys) in logical layer `layer`."""
    return dropped(x, dropout_keep(keys_BS2, layer, weight, x.shape[2:], rate), rate)


@contextlib.contextmanager
def dropout_context(drop):
    """Within it, every adapter (common/linear.py Projection) drops its input with drop: (the
    tokens' dropout keys [B, S, 2], this layer's logical index), given in a training forward
    pass with lora.dropout > 0; None: no dropout. Entered around one layer's trace, so the
    keys are values of that trace."""
    token = _DROPOUT.set(drop)
    try:
        yield
    finally:
        _DROPOUT.reset(token)


def current_dropout():
    """The innermost dropout_context's drop, or None."""
    return _DROPOUT.get()
