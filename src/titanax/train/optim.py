"""The optimizer: a table of update rules (what each keeps per parameter, and its math), the
learning-rate schedule (warmup, then cosine, linear or constant decay), and the chain the
train step runs: global-norm clipping, then the rule.

The table is the one place an update rule is described. train/offload.py streams the same
rule a layer at a time (`elementwise_update`, `clip_leaf`) and plan/memory_model.py charges
its state (`state_bytes`), so neither can drift from what the step runs."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from titanax.config import Config, OptimConfig
from titanax.models.registry import model_spec
from titanax.models.spec import no_decay_norms


@dataclasses.dataclass(frozen=True)
class UpdateRule:
    # Parameter-shaped leaves of its state, each in the parameter's dtype (optax's default
    # mu_dtype): what the memory model charges and what offload moves to the host.
    moments: int
    # (optim section, learning-rate schedule, the architecture's no_decay rule) -> the rule
    # as an optax transformation. It must be elementwise given the clipped gradient (step
    # counts and the learning rate are scalars): train/offload.py runs it on one layer's rows
    # at a time.
    transform: Callable[[OptimConfig, optax.Schedule, Callable], optax.GradientTransformation]

    def state_bytes(self, param_bytes: int) -> int:
        """Optimizer state per parameter element, in bytes."""
        return self.moments * param_bytes


def decay_mask(params, no_decay: Callable[[tuple[str, ...]], bool] = no_decay_norms):
    """True for parameters that get weight decay: all but those the architecture's no_decay
    rule names (models/spec.py; by default the norm scales)."""
    def keep(path, _):
        names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        # nnx state leaves end in the Variable's 'value'; the rule sees the parameter's path
        return not no_decay(names[:-1] if names[-1:] == ("value",) else names)
    return jax.tree_util.tree_map_with_path(keep, params)


def _adamw(o: OptimConfig, lr: optax.Schedule, no_decay) -> optax.GradientTransformation:
    # Decoupled weight decay (none where no_decay says); mu and nu in the parameters' dtype.
    return optax.adamw(lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                       mask=functools.partial(decay_mask, no_decay=no_decay))


OPTIMIZERS: dict[str, UpdateRule] = {
    "adamw": UpdateRule(moments=2, transform=_adamw),  # mu and nu: 8 bytes for float32 params
}


def update_rule(cfg: Config) -> UpdateRule:
    """The table's entry cfg trains with. AdamW is the only one; an optim field naming the
    rule would be read here."""
    del cfg
    return OPTIMIZERS["adamw"]


def lr_schedule(cfg: Config) -> optax.Schedule:
    o = cfg.optim
    decay_steps = o.decay_steps or cfg.train.steps
    warmup = round(o.warmup_fraction * decay_steps) if o.warmup_fraction > 0 else o.warmup_steps
    warmup = min(warmup, decay_steps)
    end_value = o.lr * o.min_lr_ratio
    if o.schedule == "constant":
        after = optax.constant_schedule(o.lr)
    elif o.schedule == "linear":
        after = optax.linear_schedule(o.lr, end_value, max(decay_steps - warmup, 1))
    else:
        after = optax.cosine_decay_schedule(o.lr, max(decay_steps - warmup, 1),
                                            alpha=o.min_lr_ratio)
    if warmup == 0:
        return after
    # Warmup starts at lr/warmup, not 0: step 0 already makes progress.
    return optax.join_schedules(
        [optax.linear_schedule(o.lr / warmup, o.lr, warmup), after], [warmup])


def clip_leaf(t, grad_norm, max_norm: float):
    """One leaf clipped by the global norm: optax.clip_by_global_norm's per-leaf step (its
    code, so the two paths round alike). train/offload.py computes the norm over host-resident
    leaves itself and clips each layer's rows with this."""
    trigger = jnp.squeeze(grad_norm < max_norm)
    return jax.lax.select(trigger, t, (t / grad_norm.astype(t.dtype)) * max_norm)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """optax.clip_by_global_norm through clip_leaf (state EmptyState(), as optax's)."""
    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(updates)
        return jax.tree.map(lambda t: clip_leaf(t, norm, max_norm), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def elementwise_update(cfg: Config) -> optax.GradientTransformation:
    """The rule without the clipping, chain(rule): its state is make_optimizer's last entry."""
    return optax.chain(update_rule(cfg).transform(cfg.optim, lr_schedule(cfg),
                                                  model_spec(cfg.model).no_decay))


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """chain([clip_by_global_norm,] rule): the state is (EmptyState(), rule state) or, with
    optim.clip_norm = 0, (rule state,) (checkpoints hold optax's own pytrees)."""
    o = cfg.optim
    clip = [clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    rule = update_rule(cfg).transform(o, lr_schedule(cfg), model_spec(cfg.model).no_decay)
    return optax.chain(*clip, rule)
