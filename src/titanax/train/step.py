"""Loss, train step and eval step: pure functions of (state, batch), jitted by the loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pallas_kernels.target import target_platform
from titanax import ops
from titanax.config import Config, ConfigError
from titanax.models import accumulate
from titanax.models.common.lora import DROPOUT_KEYS
from titanax.models.spec import PROBE, ModelSpec
from titanax.parallel.collective_matmul import use_collective_matmul
from titanax.parallel.pipeline import PipelineSchedule, pipeline_stages
from titanax.train import offload, self_updated
from titanax.train.resolved import resolve
from titanax.train.roles import Role, Roles, roles_for


def nll_sum(graphdef, variables, batch, *, document_masking: bool, loss_chunk: int,
            pipeline: PipelineSchedule | None = None, aux_losses=None, aux_metrics=None):
    """Sum of the per-token negative log-likelihood over the batch, float32 (the output layer
    and cross-entropy fused and chunked: no [B, S, V] logits). variables: the model's variable
    groups (nnx.States: the weights and, as the run has them, the statistics (fp8_delayed's
    amax histories) and adapters; train/state.py), merged into the model. pipeline: stage the
    layers over the mesh's 'pipeline' axis when it is > 1. aux_losses: the architecture's hook
    (ModelSpec.aux_losses); given, returns (sum, its terms of this batch, read from the model
    after the forward pass, the aux_metrics hook's values (logged only)). A batch with the
    entry DROPOUT_KEYS (the train step adds it with lora.dropout > 0) runs the adapters'
    dropout with those keys; other batches (eval, scoring) run without."""
    first, *rest = variables
    model = nnx.merge(graphdef, first, *(rest or [nnx.State({})]))
    segment_ids = batch["segment_ids"] if document_masking else None
    # (the batch entry is named as loss_sum's keyword: passed through when present)
    dropout = {k: v for k, v in batch.items() if k == DROPOUT_KEYS}
    total = model.loss_sum(batch["inputs"], batch["targets"], batch["positions"], segment_ids,
                           pipeline=pipeline, loss_chunk=loss_chunk, **dropout)
    if aux_losses is None:
        return total
    return total, dict(aux_losses(model)), dict(aux_metrics(model) if aux_metrics else {})


def step_loss_tokens(targets):
    """The mean's denominator: the targets that bear loss (ops.IGNORE_INDEX marks the others,
    e.g. a fine-tuning example's prompt), at least 1 (a batch with none has loss 0)."""
    return jnp.maximum(ops.loss_tokens(targets), 1.0)


def make_loss_fn(cfg: Config, graphdef, spec: ModelSpec, *, with_metrics: bool = False):
    """mean_loss(params, batch, fp8=None, tokens=None, fixed=()): the scalar the train step
    differentiates, with respect to params (the trained role's variables) and fp8 (the
    statistics, whose "gradient" is their updated value; None: the model has none):
    the summed loss over `tokens`, the loss-bearing targets of the whole step (all of its
    microbatches, all devices; None: this batch's own), so the step's loss is the mean over
    them whatever train.grad_accum and the layout (transformers' loss with labels=-100 on
    the same examples). execution.tp_overlap: the
    model is traced with its tensor-parallel matmuls as collective matmuls (titanax.config has
    refused the layouts they cannot run; others fall back by themselves). The config decides,
    also against an enclosing use_collective_matmul() block. fixed: the other variable groups
    the model needs, held constant (a LoRA run's frozen base, whose adapters are params).
    with_metrics: mean_loss returns (scalar, {'aux/<name>': value}) instead, the
    architecture's auxiliary loss terms and logged values (an MoE's routing statistics),
    each already weighted by the microbatch's token share ({} for a dense model). spec:
    cfg.model's (train/resolved.py), whose aux_losses and aux_metrics hooks these are."""
    masking, chunk = cfg.data.masks_documents, cfg.train.loss_chunk
    pipeline = PipelineSchedule.from_config(cfg.pipeline)

    def mean_loss(params, batch, fp8=None, tokens=None, fixed=()):
        variables = (*fixed, params, *(() if fp8 is None else (fp8,)))
        with use_collective_matmul(cfg.execution.tp_overlap):  # the context var is read at trace
            total, aux, logged = nll_sum(graphdef, variables, batch, document_masking=masking,
                                         loss_chunk=chunk, pipeline=pipeline,
                                         aux_losses=spec.aux_losses,
                                         aux_metrics=spec.aux_metrics)
        own = step_loss_tokens(batch["targets"])
        loss = total / (own if tokens is None else tokens)
        # (0.0: its gradient is a statistic, which microbatches add as it is; models/spec.py)
        loss = loss + aux.pop(PROBE, 0.0)
        if not aux and not logged:  # a dense model: the step is the token NLL alone
            return (loss, {}) if with_metrics else loss
        # The architecture's auxiliary terms (an MoE's load balancing) are means over a batch;
        # a microbatch adds its share of the step's tokens of each, so they sum to one mean.
        share = 1.0 if tokens is None else own / tokens
        loss = loss + share * sum(aux.values())
        if not with_metrics:
            return loss
        return loss, {f"aux/{k}": share * v for k, v in {**aux, **logged}.items()}

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


def _grads(cfg: Config, loss_fn, params, fp8, batch):
    """(mean loss, parameter gradients, new fp8 histories, logged auxiliary values) of the
    batch; with train.grad_accum its microbatches' gradients averaged, their histories
    combined by max_histories and their (token-share weighted) auxiliary values summed.
    loss_fn: make_loss_fn(..., with_metrics=True)'s."""
    accum = cfg.train.grad_accum
    # d/d(params) and d/d(fp8): fp8_linear's custom VJP returns the updated amax histories as
    # the "gradient" of the histories it was given; they are the step's new fp8 state.
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 2), has_aux=True)
    if accum == 1:
        (loss, logged), (grads, new_fp8) = grad_fn(params, batch, fp8)
        return loss, grads, new_fp8, logged
    # Microbatches summed inside one step: [B, S] -> [accum, B/accum, S], one scan.
    # Microbatch i takes rows i, i + accum, ...: every device keeps B/accum/devices of
    # its own rows in each, so the batch sharding stays on the row axis (a leading
    # [accum] split would put it on the scanned axis and reshard every microbatch).
    micro = jax.tree.map(lambda x: x.reshape(-1, accum, *x.shape[1:]).swapaxes(0, 1), batch)
    # Each microbatch's loss is its sum over the whole step's loss-bearing tokens, so the
    # microbatches' losses and gradients add up to the step's mean (with masked targets the
    # microbatches' counts differ: a mean of their means would weight them wrongly).
    tokens = step_loss_tokens(batch["targets"])
    # (mesh.pipeline=-1 is known only here, from the mesh: a pipeline sums the plain way.)
    if accumulate.unsupported(cfg) is None and pipeline_stages() == 1:
        # In place (models/accumulate.py): the running sum goes in, sum + gradients come out.
        def loss_into(acc, mb, fp8):
            with accumulate.accumulating(acc) as slot:
                out = loss_fn(accumulate.attach(params, acc), mb, fp8, tokens)
            if not slot.consumed:
                raise RuntimeError("gradient accumulation in place: the model never ran its "
                                   "layers through accumulate.scan_layers_into")
            return out
        step_fn = jax.value_and_grad(loss_into, argnums=(0, 2), has_aux=True)
    else:
        def step_fn(acc, mb, fp8):
            out, (grads, new_fp8) = grad_fn(params, mb, fp8, tokens)
            return out, (jax.tree.map(lambda a, g: a + g, acc, grads), new_fp8)

    def add(carry, mb):
        total_loss, total, histories = carry
        (loss, logged), (total, new_fp8) = step_fn(total, mb, fp8)
        # fp8_delayed histories: the maximum over microbatches, not the sum (TE records the
        # step's amax; ops.max_histories)
        return (total_loss + loss, total, ops.max_histories(histories, new_fp8)), logged

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params),
             jax.tree.map(jnp.zeros_like, fp8))
    # Each microbatch's gradients enter the sum already divided by the step's token count, so
    # the sum is the mean: dividing afterwards would write a second copy of it next to the
    # loop's carry (`--buffers`: 2 x 35 GB for 70B on 8 GPUs).
    (loss, grads, new_fp8), logged = jax.lax.scan(add, zeros, micro)
    # each microbatch's values carry its token share: their sum is the step's
    return loss, grads, new_fp8, jax.tree.map(lambda v: jnp.sum(v, axis=0), logged)


def make_train_step(cfg: Config, graphdef, tx: optax.GradientTransformation, schedule, *,
                    spec: ModelSpec | None = None, roles: Roles | None = None):
    """train_step(state, batch) -> (new state, metrics) on a TrainState (train/state.py): the
    loss differentiated with respect to the role the run trains (its weights, or with
    lora.rank > 0 its adapters, the weights then a frozen constant), the optimizer's update
    of those alone, the statistics set by their rules (fp8_delayed's histories by the VJP, an
    MoE's routing bias by the spec's self_updated rule). spec: cfg.model's, as the entry
    resolved it (train/resolved.py; resolved here for a caller that holds only the config);
    roles: the run's table (train/roles.py roles_for; made from cfg and spec when not given)."""
    if cfg.train.grad_accum_auto:  # a number by now: titanax.plan.fit chooses it
        raise ConfigError("train.grad_accum=auto must be resolved before the step is built "
                          "(launch.train's memory check does it)")
    offload_update = offload.enabled(cfg)
    spec = spec or resolve(cfg).spec
    loss_fn = make_loss_fn(cfg, graphdef, spec, with_metrics=True)
    roles = roles or roles_for(cfg, spec)
    trains, own = roles.trains, roles.self_updated

    def train_step(state, batch):  # a train/state.py TrainState
        params = state.variables[trains]
        fp8 = state.statistics if state.statistics is not None else nnx.State({})
        # The frozen groups (a LoRA run's base) enter as constants, so no gradient of theirs
        # is ever computed (only the activations' back through them), and they leave untouched.
        fixed = tuple(v for r, v in state.variables.items() if r not in (trains, Role.STATISTIC))
        step_loss = (lambda p, b, f=None, t=None: loss_fn(p, b, f, t, fixed=fixed)) \
            if fixed else loss_fn
        batch = roles.step_inputs(batch, state.step)  # (LoRA's adapter dropout keys)
        loss, grads, new_fp8, logged = _grads(cfg, step_loss, params, fp8, batch)
        # An MoE's routing bias: its "gradient" is the step's loads, not the optimizer's.
        raw_grads = grads
        if own is not None:
            grads = self_updated.without_statistics(own, grads)
        # (offload_params: the layers' gradients are in host memory, read a layer at a time)
        grad_norm = offload.global_norm(grads) if offload_update else optax.tree.norm(grads)
        # A non-finite amax (inf/NaN in an FP8 operand, e.g. an overflowing gradient that the
        # saturating cast hid from the loss) would sit in its history for execution.fp8_amax_history
        # steps, each of them scaled by 1.0: the step is skipped instead, histories included.
        nonfinite_amax = ops.count_nonfinite_amax(new_fp8)
        # One NaN/inf (an overflow, a broken batch) would poison the weights and Adam's moments
        # for good: such a step keeps the old ones. The step still advances (a batch was
        # consumed; the data position and the step count stay in lockstep) and the loop counts
        # the skip.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & (nonfinite_amax == 0)
        if offload_update:
            # Host-resident moments / layer weights: the same update, streamed one layer at a
            # time through the device (train/offload.py), the guard folded in.
            new_params, new_opt_state = offload.streamed_update(
                cfg, tx, grads, state.opt_state, params, grad_norm, finite,
                no_decay=spec.no_decay)
            new_fp8 = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_fp8, fp8)
        else:
            updates, opt_state = tx.update(grads, state.opt_state, params)
            new_params, new_opt_state, new_fp8 = _keep_if_finite(
                finite, (optax.apply_updates(params, updates), opt_state, new_fp8),
                (params, state.opt_state, fp8))
        if own is not None:
            new_params = self_updated.with_updates(own, new_params, params, raw_grads, finite)
        variables = {**state.variables, trains: new_params}
        if state.statistics is not None:
            variables[Role.STATISTIC] = new_fp8
        new_state = state.replace(step=state.step + 1, variables=variables,
                                  opt_state=new_opt_state)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step),
                   "skipped": (~finite).astype(jnp.int32), "fp8_nonfinite_amax": nonfinite_amax,
                   **logged}
        return new_state, metrics

    return train_step


def make_eval_step(cfg: Config, graphdef):
    masking, chunk = cfg.data.masks_documents, cfg.train.loss_chunk
    pipeline = PipelineSchedule.from_config(cfg.pipeline)

    def eval_step(variables, batch):
        """variables: all of the train state's variable groups (TrainState.model_variables:
        under fp8_delayed the histories scale the forward pass; with LoRA the adapters)."""
        total = nll_sum(graphdef, variables, batch, document_masking=masking, loss_chunk=chunk,
                        pipeline=pipeline)
        return total, ops.loss_tokens(batch["targets"])

    return eval_step
