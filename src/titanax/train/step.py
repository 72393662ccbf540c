"""Loss, train step and eval step: pure functions of (state, batch), jitted by the loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pallas_kernels.target import target_platform
from titanax import ops
from titanax.config import Config
from titanax.ops.linear import accumulate_grads, count_nonfinite_amax, mean_grads
from titanax.parallel.pipeline import PipelineSchedule
from titanax.train import offload


def nll_sum(graphdef, params, batch, *, document_masking: bool, loss_chunk: int,
            pipeline: PipelineSchedule | None = None):
    """Sum of the per-token negative log-likelihood over the batch, float32 (the output layer
    and cross-entropy fused and chunked: no [B, S, V] logits). pipeline: stage the layers over
    the mesh's 'pipeline' axis when it is > 1."""
    model = nnx.merge(graphdef, params)
    segment_ids = batch["segment_ids"] if document_masking else None
    return model.loss_sum(batch["inputs"], batch["targets"], batch["positions"], segment_ids,
                          pipeline=pipeline, loss_chunk=loss_chunk)


def make_loss_fn(cfg: Config, graphdef):
    """mean_loss(params, batch): the scalar the train step differentiates."""
    masking, chunk = cfg.data.document_masking, cfg.train.loss_chunk
    pipeline = PipelineSchedule.from_config(cfg.pipeline)

    def mean_loss(params, batch):
        total = nll_sum(graphdef, params, batch, document_masking=masking, loss_chunk=chunk,
                        pipeline=pipeline)
        return total / batch["targets"].size

    return mean_loss


def _keep_if_finite(finite, new, old):
    """new where the step is finite, else old. On GPU an elementwise select, which XLA folds
    into the fusion computing each update, so the new values are written in place over the
    donated state (a lax.cond choosing between two whole states made XLA hold a second copy
    of params and moments: 52 GB per GPU for Llama-3-70B on 8 B200s, docs/planner.md). XLA:CPU
    does not fold the select and pays a pass over the state for it (4% of a step of the
    peer benchmark, docs/performance.md), so the CPU keeps the cond."""
    if target_platform() == "cpu":
        return jax.lax.cond(finite, lambda: new, lambda: old)
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def make_train_step(cfg: Config, graphdef, tx: optax.GradientTransformation, schedule):
    accum = cfg.train.grad_accum
    offload_update = offload.enabled(cfg)
    grad_fn = jax.value_and_grad(make_loss_fn(cfg, graphdef))

    def train_step(state, batch):
        params = state["params"]
        if accum == 1:
            loss, grads = grad_fn(params, batch)
        else:
            # Microbatches summed inside one step: [B, S] -> [accum, B/accum, S], one scan.
            # Microbatch i takes rows i, i + accum, ...: every device keeps B/accum/devices of
            # its own rows in each, so the batch sharding stays on the row axis (a leading
            # [accum] split would put it on the scanned axis and reshard every microbatch).
            micro = jax.tree.map(
                lambda x: x.reshape(-1, accum, *x.shape[1:]).swapaxes(0, 1), batch)

            def add(carry, mb):
                loss, grads = grad_fn(params, mb)
                # fp8_delayed histories: the maximum over microbatches, not the sum (TE records
                # the step's amax; accumulate_grads in ops/linear.py)
                return (carry[0] + loss, accumulate_grads(carry[1], grads)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(add, zeros, micro)
            loss, grads = loss / accum, mean_grads(grads, accum)
        # fp8_delayed: the amax histories (ops.Fp8Meta, inside params) get their updated values
        # as "gradients"; they bypass the optimizer and the norm and are written back below.
        grads, fp8_meta = ops.split_fp8_meta(grads)
        # (offload_params: the layers' gradients are in host memory, read a layer at a time)
        grad_norm = offload.global_norm(grads) if offload_update else optax.tree.norm(grads)
        # A non-finite amax (inf/NaN in an FP8 operand, e.g. an overflowing gradient that the
        # saturating cast hid from the loss) would sit in its history for model.fp8_amax_history
        # steps, each of them scaled by 1.0: the step is skipped instead, histories included.
        nonfinite_amax = count_nonfinite_amax(fp8_meta)
        # One NaN/inf (an overflow, a broken batch) would poison the weights and Adam's moments
        # for good: such a step keeps the old ones. 'step' still advances (a batch was consumed;
        # the data position and the step count stay in lockstep) and the loop counts the skip.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (nonfinite_amax == 0)
        if offload_update:
            # Host-resident moments / layer weights: the same update, streamed one layer at a
            # time through the device (train/offload.py), the guard folded in.
            new_params, new_opt_state = offload.streamed_update(
                cfg, tx, grads, fp8_meta, state["opt_state"], params, grad_norm, finite)
        else:
            updates, opt_state = tx.update(grads, state["opt_state"], params)
            new_params = ops.merge_fp8_meta(optax.apply_updates(params, updates), fp8_meta)
            new_params, new_opt_state = _keep_if_finite(
                finite, (new_params, opt_state), (params, state["opt_state"]))
        new_state = {"step": state["step"] + 1, "params": new_params,
                     "opt_state": new_opt_state}
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state["step"]),
                   "skipped": (~finite).astype(jnp.int32), "fp8_nonfinite_amax": nonfinite_amax}
        return new_state, metrics

    return train_step


def make_eval_step(cfg: Config, graphdef):
    masking, chunk = cfg.data.document_masking, cfg.train.loss_chunk
    pipeline = PipelineSchedule.from_config(cfg.pipeline)

    def eval_step(params, batch):
        total = nll_sum(graphdef, params, batch, document_masking=masking, loss_chunk=chunk,
                        pipeline=pipeline)
        return total, jnp.asarray(batch["targets"].size, jnp.float32)

    return eval_step
