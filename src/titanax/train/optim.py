"""The optimizer: a table of update rules (what each keeps per parameter, and its math), the
learning-rate schedule (warmup, then cosine, linear or constant decay, or wsd's stable phase
and late decay; docs/schedules.md), and the chain the train step runs: global-norm clipping,
then the rule.

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


def param_names(path) -> tuple[str, ...]:
    """A params-tree leaf's key path as the parameter's names, e.g. ('layers', 'router'):
    nnx state leaves end in the Variable's 'value', which is dropped."""
    names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
    return names[:-1] if names[-1:] == ("value",) else names


def decay_mask(params, no_decay: Callable[[tuple[str, ...]], bool] = no_decay_norms):
    """True for parameters that get weight decay: all but those the architecture's no_decay
    rule names (models/spec.py; by default the norm scales)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: not no_decay(param_names(path)),
                                            params)


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


def schedule_horizon(cfg: Config) -> int:
    """The step the schedule ends at: optim.decay_steps, or train.steps when that is 0."""
    return cfg.optim.decay_steps or cfg.train.steps


def warmup_steps(cfg: Config) -> int:
    o, horizon = cfg.optim, schedule_horizon(cfg)
    warmup = round(o.warmup_fraction * horizon) if o.warmup_fraction > 0 else o.warmup_steps
    return min(warmup, horizon)


# wsd's decay factor at progress p in [0, 1] through the decay: 1 at its start, 0 at its end.
DECAY_FACTORS: dict[str, Callable] = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + jnp.cos(jnp.pi * p)),
    "sqrt": lambda p: 1.0 - jnp.sqrt(p),  # TorchTitan's: falls fast early, then flattens
}


def wsd_decay_start(cfg: Config) -> int:
    """The first step of wsd's decay: the horizon less its last decay_fraction (rounded), never
    inside the warmup."""
    horizon = schedule_horizon(cfg)
    return max(horizon - round(cfg.optim.decay_fraction * horizon), warmup_steps(cfg))


def _wsd_after_warmup(cfg: Config) -> optax.Schedule:
    """lr until the decay starts, then lr * (m + (1 - m) * factor(p)), m = min_lr_ratio; the
    count starts at the end of the warmup."""
    o, warmup = cfg.optim, warmup_steps(cfg)
    stable = wsd_decay_start(cfg) - warmup
    length = max(schedule_horizon(cfg) - wsd_decay_start(cfg), 1)
    factor = DECAY_FACTORS[o.decay_shape]

    def decay(count):
        p = jnp.clip(count / length, 0.0, 1.0)
        return o.lr * (o.min_lr_ratio + (1.0 - o.min_lr_ratio) * factor(p))

    if stable == 0:
        return decay
    # The stable phase is optax's constant: exactly lr, not a decay at p = 0 rounded.
    return optax.join_schedules([optax.constant_schedule(o.lr), decay], [stable])


def lr_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup, then cosine, linear or no decay to lr * min_lr_ratio at the horizon, or
    wsd's stable phase and late decay (docs/schedules.md has the formulas)."""
    o = cfg.optim
    horizon, warmup = schedule_horizon(cfg), warmup_steps(cfg)
    end_value = o.lr * o.min_lr_ratio
    if o.schedule == "constant":
        after = optax.constant_schedule(o.lr)
    elif o.schedule == "linear":
        after = optax.linear_schedule(o.lr, end_value, max(horizon - warmup, 1))
    elif o.schedule == "wsd":
        after = _wsd_after_warmup(cfg)
    else:
        after = optax.cosine_decay_schedule(o.lr, max(horizon - warmup, 1),
                                            alpha=o.min_lr_ratio)
    if warmup == 0:
        return after
    # Warmup starts at lr/warmup, not 0: step 0 already makes progress.
    return optax.join_schedules(
        [optax.linear_schedule(o.lr / warmup, o.lr, warmup), after], [warmup])


def horizon_change(saved: Config, cfg: Config, step: int) -> str:
    """The run-log line for a resume at step whose schedule or horizon differs from the
    checkpoint's (saved): the step count carries on, so from here the learning rate follows
    the new curve, not the one the run began on. '' when neither changed."""
    old, new = schedule_horizon(saved), schedule_horizon(cfg)
    was, now = saved.optim.schedule, cfg.optim.schedule
    changes, keep, why = [], [], ""
    if old != new:
        why = (" (optim.decay_steps changed)" if saved.optim.decay_steps != cfg.optim.decay_steps
               else f" (train.steps {'grew' if new > old else 'shrank'})")
        changes.append(f"the schedule's horizon changes from {old} to {new} steps")
        keep.append(f"optim.decay_steps={old}")
    if was != now:
        changes.append(f"optim.schedule changes from {was} to {now}")
        keep.append(f"optim.schedule={was}")
    if not changes:
        return ""
    return (f"optim: {' and '.join(changes)} at step {step}{why}: the learning rate from here "
            f"follows the new curve; set {' '.join(keep)} to keep the old one")


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


def elementwise_update(cfg: Config, no_decay=no_decay_norms) -> optax.GradientTransformation:
    """The rule without the clipping, chain(rule): its state is make_optimizer's last entry."""
    return optax.chain(update_rule(cfg).transform(cfg.optim, lr_schedule(cfg), no_decay))


def make_optimizer(cfg: Config, *, no_decay: Callable[[tuple[str, ...]], bool] = no_decay_norms
                   ) -> optax.GradientTransformation:
    """chain([clip_by_global_norm,] rule): the state is (EmptyState(), rule state) or, with
    optim.clip_norm = 0, (rule state,) (checkpoints hold optax's own pytrees). no_decay: the
    model spec's rule (ModelSpec.no_decay, passed by the entry that resolved it,
    train/resolved.py); by default the spec's default, norm scales undecayed."""
    o = cfg.optim
    clip = [clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    rule = update_rule(cfg).transform(o, lr_schedule(cfg), no_decay)
    return optax.chain(*clip, rule)
