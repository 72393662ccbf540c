"""The output layer and cross-entropy fused, chunked over the sequence: no [B, S, V] float32
tensor exists in the forward or the backward pass.

`linear_cross_entropy_sum(h_BSD, w_DV, targets_BS, chunk=c)` = sum over tokens of
logsumexp(h w) - (h w)[target], in float32, the same value and gradients as the dense
reference (`dense_cross_entropy_sum`, what the model computed before). For Llama-3-70B at 4 x 8192
tokens per GPU the dense float32 logits and their gradient are ~34 GB; chunked, one chunk's
logits are alive at a time.

How: a custom VJP whose forward pass also computes the gradients, chunk by chunk (a scan over
the sequence, so each device keeps its batch rows and the batch sharding never moves):
logits_c = h_c w, p_c = softmax(logits_c), dlogits_c = p_c - onehot(target), dh_c = dlogits_c w^T,
dW += h_c^T dlogits_c (float32 accumulator). The loss is a scalar sum, so the backward pass
only scales dh and dW by the incoming cotangent: the logits are computed once, not recomputed
(the same 3 matmuls per chunk as the dense forward + backward). Called without
differentiation (evaluation) it computes the loss only.

Sharding: the vocabulary axis of the logits follows the 'vocab' activation rule (tensor
parallel: each device holds V/tp columns and the logsumexp reduces across them); the weight is
gathered over FSDP once, before the scan, as the dense path does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from titanax.parallel.rules import batch_shards, shard_activation

_PRECISION = {"default": None, "highest": jax.lax.Precision.HIGHEST}
# A target that bears no loss (a prompt token of a fine-tuning example, padding): it adds
# nothing to the sum and gets no gradient, and the step's mean does not count it
# (train/step.py). -100 as in PyTorch's cross_entropy and transformers' labels.
IGNORE_INDEX = -100


def loss_tokens(targets):
    """How many of `targets` bear loss (are not IGNORE_INDEX), float32."""
    return jnp.sum(targets != IGNORE_INDEX, dtype=jnp.float32)


def chunk_positions(seq_len: int, rows: int, chunk_tokens: int) -> int:
    """Sequence positions per chunk: the largest divisor of seq_len whose chunk of `rows`
    (this device's batch rows) x positions holds at most chunk_tokens tokens (at least one
    position). chunk_tokens <= 0: the whole sequence at once."""
    if chunk_tokens <= 0:
        return seq_len
    target = max(1, chunk_tokens // max(rows, 1))
    return max(c for c in range(1, min(target, seq_len) + 1) if seq_len % c == 0)


def dense_cross_entropy_sum(h_BSD, w_DV, targets_BS, *, precision: str = "default"):
    """The reference: full [B, S, V] float32 logits, logsumexp minus the target logit, over
    the targets that bear loss (not IGNORE_INDEX)."""
    logits_BSV = jnp.dot(h_BSD, w_DV, precision=_PRECISION[precision]).astype(jnp.float32)
    keep_BS = targets_BS != IGNORE_INDEX
    target_BS = jnp.take_along_axis(logits_BSV, jnp.where(keep_BS, targets_BS, 0)[..., None],
                                    axis=-1)[..., 0]
    return jnp.sum(jnp.where(keep_BS, jax.nn.logsumexp(logits_BSV, axis=-1) - target_BS, 0.0))


def seq_split(seq_len: int) -> int:
    """Devices the 'seq' rule splits a sequence of seq_len over (1 if they do not divide it)."""
    n = batch_shards("seq")
    return n if seq_len % n == 0 else 1


def _chunks(x_BS, c: int):
    """[B, S, ...] -> [S/(n c), B, n c, ...] with n the devices the sequence is split over
    ('seq' on 'context'; 1 without): chunk k is positions k*c..(k+1)*c of each device's part
    of every row, so every chunk keeps the sequence sharding and no device waits on another's
    positions. The loss is a sum over tokens: their order within a chunk does not matter."""
    B, S = x_BS.shape[:2]
    n = seq_split(S)
    x = x_BS.reshape(B, n, S // (n * c), c, *x_BS.shape[2:])
    x = jnp.moveaxis(x, 2, 0)  # [S/(n c), B, n, c, ...]
    return x.reshape(S // (n * c), B, n * c, *x_BS.shape[2:])


def _unchunk(x_CBs):
    C, B, nc = x_CBs.shape[:3]
    n = seq_split(C * nc)
    x = x_CBs.reshape(C, B, n, nc // n, *x_CBs.shape[3:])
    return jnp.moveaxis(x, 0, 2).reshape(B, C * nc, *x_CBs.shape[3:])


def _logits(h_BsD, w_DV, precision, rows):
    logits_BsV = jnp.dot(h_BsD, w_DV, precision=_PRECISION[precision])
    return shard_activation(logits_BsV.astype(jnp.float32), (rows, "seq", "vocab"))


def _nll_and_dlogits(logits_BsV, targets_Bs, with_grad: bool):
    """(sum of nll over the chunk, dnll/dlogits or None). The target logit by an iota compare
    (fused with the logsumexp pass, and partitionable over a vocab-sharded axis)."""
    V = logits_BsV.shape[-1]
    is_target_BsV = jnp.arange(V)[None, None, :] == targets_Bs[..., None]
    lse_Bs = jax.nn.logsumexp(logits_BsV, axis=-1)
    target_Bs = jnp.sum(jnp.where(is_target_BsV, logits_BsV, 0.0), axis=-1)
    # A target outside the vocabulary is broken data: NaN, so the step's non-finite guard
    # skips and counts it (as the dense gather did), rather than a silently wrong loss.
    target_Bs = jnp.where((targets_Bs >= 0) & (targets_Bs < V), target_Bs, jnp.nan)
    keep_Bs = targets_Bs != IGNORE_INDEX  # no loss, no gradient
    nll = jnp.sum(jnp.where(keep_Bs, lse_Bs - target_Bs, 0.0))
    if not with_grad:
        return nll, None
    dlogits_BsV = jnp.where(keep_Bs[..., None],
                            jnp.exp(logits_BsV - lse_Bs[..., None]) - is_target_BsV, 0.0)
    return nll, dlogits_BsV


def _zero(like):
    """A float32 0 typed like `like` (varying over the same manual mesh axes inside a
    shard_map, e.g. a pipeline stage), so the scans' carries keep one type."""
    return jnp.zeros_like(like, jnp.float32, shape=())


def _prepare(h_BSD, w_DV, targets_BS, c, rows):
    # Whole sequences per device before chunking (the sequence-parallel regions split it over
    # 'tensor'), and the weight gathered over FSDP once rather than in every chunk.
    h_BSD = shard_activation(h_BSD, (rows, "seq", "embed"))
    w_DV = shard_activation(w_DV.astype(h_BSD.dtype), ("embed", "vocab"))
    return _chunks(h_BSD, c), w_DV, _chunks(targets_BS, c)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ce_sum(h_BSD, w_DV, targets_BS, c: int, precision: str, rows: str):
    h_CBsD, w_DV, t_CBs = _prepare(h_BSD, w_DV, targets_BS, c, rows)

    def body(total, xs):
        h_BsD, t_Bs = xs
        nll, _ = _nll_and_dlogits(_logits(h_BsD, w_DV, precision, rows), t_Bs, with_grad=False)
        return total + nll, None

    total, _ = jax.lax.scan(body, _zero(h_CBsD), (h_CBsD, t_CBs))
    return total


def _ce_sum_fwd(h_BSD, w_DV, targets_BS, c, precision, rows):
    h_CBsD, w_g_DV, t_CBs = _prepare(h_BSD, w_DV, targets_BS, c, rows)
    dt, wdt = h_BSD.dtype, w_DV.dtype

    def body(carry, xs):
        total, dw_DV = carry
        h_BsD, t_Bs = xs
        nll, dlogits_BsV = _nll_and_dlogits(_logits(h_BsD, w_g_DV, precision, rows), t_Bs,
                                            with_grad=True)
        dlogits_BsV = dlogits_BsV.astype(dt)
        dh_BsD = jnp.dot(dlogits_BsV, w_g_DV.T, precision=_PRECISION[precision])
        # The chunk's partial weight gradient leaves the matmul in the weight's dtype, the
        # dtype FSDP reduces gradients in (execution.grad_reduce_dtype: float32 only when the
        # weight came in as float32): under FSDP this [d, vocab] partial is reduce-scattered
        # every chunk, and a float32 one doubled both that traffic and its buffer (4.2 GB for
        # 70B, the peak of the 8x H100 offload step). The running sum stays float32.
        dw_DV = dw_DV + jnp.einsum("bcd,bcv->dv", h_BsD, dlogits_BsV,
                                   precision=_PRECISION[precision],
                                   preferred_element_type=wdt).astype(jnp.float32)
        return (total + nll, dw_DV), dh_BsD.astype(dt)

    zeros_DV = shard_activation(jnp.zeros_like(w_g_DV, jnp.float32) + _zero(h_CBsD),
                                ("embed", "vocab"))
    (total, dw_DV), dh_CBsD = jax.lax.scan(body, (_zero(h_CBsD), zeros_DV), (h_CBsD, t_CBs))
    # Residuals in the operands' dtypes: the float32 sum is rounded once, where the dense
    # backward's dot rounds its output.
    return total, (_unchunk(dh_CBsD), dw_DV.astype(w_DV.dtype))


def _ce_sum_bwd(c, precision, rows, res, g):
    dh_BSD, dw_DV = res
    return ((dh_BSD * g.astype(dh_BSD.dtype)).astype(dh_BSD.dtype),
            (dw_DV * g.astype(dw_DV.dtype)).astype(dw_DV.dtype), None)


_ce_sum.defvjp(_ce_sum_fwd, _ce_sum_bwd)


def linear_cross_entropy_sum(h_BSD, w_DV, targets_BS, *, chunk: int,
                             precision: str = "default", rows: str = "batch"):
    """sum over all tokens of -log softmax(h w)[target], float32, chunked over the sequence;
    a target of IGNORE_INDEX adds nothing and gets no gradient.

    h_BSD in the compute dtype; w_DV in it or in float32 (cast here; its gradient comes back in
    w_DV's own dtype, summed over the chunks in float32 either way); chunk: sequence positions per
    chunk, a divisor of S (see chunk_positions); rows: the logical axis name of the batch
    rows' sharding (parallel/rules.py); chunk counts positions of one device's part of the
    sequence when it is split over 'context'. Differentiable in h and w."""
    S = h_BSD.shape[1] // seq_split(h_BSD.shape[1])  # positions per device
    if chunk <= 0 or S % chunk:
        raise ValueError(f"chunk={chunk} must be a positive divisor of the sequence length "
                         f"per device {S}")
    return _ce_sum(h_BSD, w_DV, targets_BS.astype(jnp.int32), chunk, precision, rows)
