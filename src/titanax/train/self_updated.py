"""Parameters the optimizer does not train (models/spec.py SelfUpdated: an MoE's routing bias,
models/common/moe_bias.py): the train step takes their gradients, which are statistics of the
step, out of what the optimizer sees, and sets each from its old value and its statistic."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from titanax.models.spec import SelfUpdated
from titanax.train.offload import on_host
from titanax.train.optim import param_names


def without_statistics(own: SelfUpdated, grads):
    """grads with the self-updated parameters' zeroed: they count in neither the gradient
    norm nor its clipping, and the optimizer's own update of them (their moments stay zero)
    is replaced by `with_updates`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: jnp.zeros_like(g) if own.selects(param_names(path)) else g, grads)


def _on_device(x):
    # train.offload_params keeps the layer stack (this parameter and its gradient included)
    # in host memory: the update runs on the device and its result goes back.
    return jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x


def with_updates(own: SelfUpdated, new_params, params, grads, finite):
    """new_params (the optimizer's) with each self-updated parameter set to own.update(its
    value before the step, its statistic in grads) when the step is finite, else kept."""
    def put(path, new, old, stat):
        if not own.selects(param_names(path)):
            return new
        value = _on_device(old)
        out = jnp.where(finite, own.update(value, _on_device(stat)), value).astype(old.dtype)
        return jax.device_put(out, jax.memory.Space.Host) if on_host(old) else out
    return jax.tree_util.tree_map_with_path(put, new_params, params, grads)
