"""Optimizer: AdamW with decoupled weight decay (none on norm scales), warmup then cosine (or
linear/constant) decay, and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from titanax.config import Config


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


def decay_mask(params):
    """True for parameters that get weight decay: everything but norm scales."""
    def keep(path, _):
        names = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        return "norm" not in names
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    parts = []
    if o.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(o.clip_norm))
    parts.append(optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
