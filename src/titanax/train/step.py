"""Loss, train step and eval step: pure functions of (state, batch), jitted by the loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from titanax.config import Config


def token_nll(graphdef, params, batch, *, document_masking: bool):
    """Per-token negative log-likelihood [B, S] in float32."""
    model = nnx.merge(graphdef, params)
    segment_ids = batch["segment_ids"] if document_masking else None
    logits_BSV, _ = model(batch["inputs"], batch["positions"], segment_ids)
    logp_BSV = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp_BSV, batch["targets"][..., None], axis=-1)[..., 0]


def make_train_step(cfg: Config, graphdef, tx: optax.GradientTransformation, schedule):
    masking = cfg.data.document_masking
    accum = cfg.train.grad_accum

    def mean_loss(params, batch):
        return token_nll(graphdef, params, batch, document_masking=masking).mean()

    grad_fn = jax.value_and_grad(mean_loss)

    def train_step(state, batch):
        params = state["params"]
        if accum == 1:
            loss, grads = grad_fn(params, batch)
        else:
            # Microbatches summed inside one step: [B, S] -> [accum, B/accum, S], one scan.
            micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), batch)

            def add(carry, mb):
                loss, grads = grad_fn(params, mb)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(add, zeros, micro)
            loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                     "opt_state": opt_state}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"])}
        return new_state, metrics

    return train_step


def make_eval_step(cfg: Config, graphdef):
    masking = cfg.data.document_masking

    def eval_step(params, batch):
        nll = token_nll(graphdef, params, batch, document_masking=masking)
        return nll.sum(), jnp.asarray(nll.size, jnp.float32)

    return eval_step
