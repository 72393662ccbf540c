"""The model's side of evaluation: token log-probabilities and greedy next tokens for a batch of
right-padded sequences. Shapes are padded to a few buckets (batch to a fixed size, length to a
power of two), so a whole evaluation compiles a handful of times, not once per request.

Right padding needs no attention mask: the model is causal, so a position never sees the pads
after it, and the pads' own outputs are simply not read."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

MIN_BUCKET = 16


def bucket(length: int, max_len: int) -> int:
    """The padded length for `length` tokens: the next power of two (at least MIN_BUCKET),
    capped at the model's max_len."""
    if length > max_len:
        raise ValueError(f"{length} tokens exceed the model's max_seq_len={max_len}")
    return min(max_len, max(MIN_BUCKET, 1 << (length - 1).bit_length()))


def pad_batch(rows: list[list[int]], batch_size: int, length: int, pad_id: int) -> np.ndarray:
    """[batch_size, length] int32, rows left-aligned; missing rows are all pad (never read)."""
    out = np.full((batch_size, length), pad_id, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return out


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _token_scores(graphdef, params, tokens_BS, targets_BS):
    logits_BSV = nnx.merge(graphdef, params)(tokens_BS)[0].astype(jnp.float32)
    logp_BSV = jax.nn.log_softmax(logits_BSV, axis=-1)
    logp_BS = jnp.take_along_axis(logp_BSV, targets_BS[..., None], axis=-1)[..., 0]
    return logp_BS, jnp.argmax(logits_BSV, axis=-1) == targets_BS


def token_scores(graphdef, params, tokens: np.ndarray, targets: np.ndarray):
    """(log p(targets[b, s] | tokens[b, :s+1]), whether that target is the argmax), as numpy
    [B, S] float32 and bool. Only [B, S] leaves the device, never the [B, S, vocab] logits."""
    logp, greedy = _token_scores(graphdef, params, jnp.asarray(tokens), jnp.asarray(targets))
    return np.asarray(logp), np.asarray(greedy)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _last_logits(graphdef, params, tokens_BS, lengths_B):
    logits_BSV = nnx.merge(graphdef, params)(tokens_BS)[0]
    return jnp.take_along_axis(logits_BSV, (lengths_B - 1)[:, None, None], axis=1)[:, 0]


def next_tokens(graphdef, params, tokens: np.ndarray, lengths: np.ndarray, *,
                temperature: float = 0.0, key=None) -> np.ndarray:
    """The token after each row's first `lengths[b]` tokens: argmax (temperature 0) or sampled.
    Recomputes the whole padded window each call: the model's KV cache keeps one fill position
    for the batch, which rows of different lengths cannot share."""
    logits_BV = _last_logits(graphdef, params, jnp.asarray(tokens),
                             jnp.asarray(lengths, jnp.int32)).astype(jnp.float32)
    if temperature == 0.0:
        return np.asarray(jnp.argmax(logits_BV, axis=-1))
    return np.asarray(jax.random.categorical(key, logits_BV / temperature, axis=-1))
