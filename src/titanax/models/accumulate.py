"""Gradient accumulation in place: one float32 gradient buffer, the size of the (sharded)
parameters, for all of a step's microbatches.

The plain way (step.py `_grads`) scans the microbatches with a zero-initialised sum as the
carry and adds each microbatch's gradients to it; XLA then holds the sum, the loop's carry and
the backward pass's fresh [layers, ...] gradient stack at once: three float32 copies of the
parameters (35.3 GB each per GPU for Llama-3-70B on 8 GPUs), which is what kept the 70B preset
at its own batch off one B200 node (docs/planner.md).

Here the running sum is an input of the loss, and its "gradient" is the sum plus this
microbatch's gradients:
- the decoder layers run through `scan_layers_into`, a custom VJP of the layer scan whose
  backward walks the layers in reverse with the sum in its carry and adds each layer's
  (reduce-scattered) weight gradients into the sum's slice for that layer: one layer's fresh
  gradients at a time, never a stack of them;
- every other parameter (embedding, final norm, output layer) goes through `attach`, whose
  backward returns sum + gradient.
The microbatch scan carries the sum, so XLA updates one buffer in place from the first
microbatch to the last.

The layers' backward recomputes each layer from its saved input (what execution.remat='full'
keeps: the same memory and FLOPs; 'full_offload' keeps it in pinned host memory), so it applies
where the step runs the layers as one scan under those; `unsupported` names the layouts that
keep the plain path and why.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from titanax.config import Config, grad_accum_in_place_unsupported

LAYERS = "layers"  # Decoder's attribute holding the stacked blocks


def unsupported(cfg: Config) -> str | None:
    """Why a step of this config accumulates the plain way, or None: it runs in place."""
    return grad_accum_in_place_unsupported(cfg)


@dataclasses.dataclass
class _Slot:
    acc: nnx.State  # the running sum, laid out like the parameters
    # Each gradient enters the sum times this (the train step's loss is already divided by
    # the whole step's token count, so it passes 1).
    scale: float = 1.0
    consumed: bool = False


_SLOT: contextvars.ContextVar[_Slot | None] = contextvars.ContextVar("titanax_grad_sum",
                                                                    default=None)


@contextlib.contextmanager
def accumulating(acc, scale: float = 1.0):
    """Model code traced inside this block adds its layers' gradients, times `scale`, into
    `acc` (the running sum, the parameters' structure): Decoder._run_layers takes it from
    `pending()`. (The train step passes 1: its loss is already divided by the whole step's
    token count, so the sum is the mean; dividing it afterwards would write a second copy.)"""
    slot = _Slot(acc, scale)
    token = _SLOT.set(slot)
    try:
        yield slot
    finally:
        _SLOT.reset(token)


def pending() -> _Slot | None:
    return _SLOT.get()


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _attach(param, acc, scale):
    return param


def _attach_fwd(param, acc, scale):
    return param, acc


def _attach_bwd(scale, acc, ct):
    return None, acc + _scaled(ct, scale, acc.dtype)


def _scaled(g, scale: float, dtype):
    return (g if scale == 1.0 else g * scale).astype(dtype)


_attach.defvjp(_attach_fwd, _attach_bwd)


def attach(params, acc, scale: float = 1.0):
    """params with every leaf outside the layer stack tied to acc's: the gradient of acc is
    then acc + scale x d(loss)/d(param). The layer stack's leaves are left alone
    (scan_layers_into)."""
    def tie(path, p, a):
        top = getattr(path[0], "key", None) if path else None
        return p if top == LAYERS else _attach(p, a, scale)
    return jax.tree_util.tree_map_with_path(tie, params, acc)


def to_device(x):
    """x in device memory: a host-resident array (train.offload_params) is copied over."""
    if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def scan_layers_into(slot: _Slot, one_layer, layer_state, x, extras, *,
                     offload_inputs: bool = False):
    """x after every layer: one_layer(x, state_l, *extras) -> x over layer_state's leading
    axis, as jax.lax.scan would, with the backward adding the weight gradients into
    slot.acc[LAYERS] in place (module docstring). Other state of the layers (fp8_delayed's
    amax histories) gets its per-layer cotangents as usual. offload_inputs (execution.remat=
    'full_offload'): each layer's saved input goes to pinned host memory in the forward and
    comes back for its layer's backward."""
    params, rest = nnx.split_state(layer_state, nnx.Param, ...)
    p_leaves, p_def = jax.tree.flatten(params)
    r_leaves, r_def = jax.tree.flatten(rest)
    a_leaves = jax.tree.leaves(slot.acc[LAYERS])
    if [a.shape for a in a_leaves] != [p.shape for p in p_leaves]:
        raise ValueError("gradient accumulation in place: the running sum's layer leaves "
                         f"{[a.shape for a in a_leaves]} do not match the layers' parameters "
                         f"{[p.shape for p in p_leaves]}")
    slot.consumed = True
    n_layers = p_leaves[0].shape[0]
    # The backward is traced after the forward has returned, outside the `with` blocks the
    # model was traced in (use_collective_matmul and the like): it runs in their snapshot.
    snapshot = contextvars.copy_context()

    def layer(x, p, r, extras):
        state = nnx.merge_state(jax.tree.unflatten(p_def, p), jax.tree.unflatten(r_def, r))
        return one_layer(x, state, *extras)

    @jax.custom_vjp
    def run(p, r, a, x, extras):
        return jax.lax.scan(lambda x, pr: (layer(x, *pr, extras), None), x, (p, r))[0]

    def save(x):
        return jax.device_put(x, jax.memory.Space.Host) if offload_inputs else x

    def load(x):
        return jax.device_put(x, jax.memory.Space.Device) if offload_inputs else x

    def run_fwd(p, r, a, x, extras):
        y, inputs = jax.lax.scan(lambda x, pr: (layer(x, *pr, extras), save(x)), x, (p, r))
        return y, (p, r, a, inputs, extras)

    def run_bwd(res, dy):
        p, r, a, inputs, extras = res

        def back(carry, xs):
            dx, a = carry
            i, p_l, r_l, x_l = xs
            x_l = load(x_l)
            # train.offload_params: the layer's weights come over from host memory here, so
            # the VJP's weight gradients are device arrays, added into the device sum (the
            # VJP of the layer's own copy would hand them back in host memory).
            p_l = [to_device(w) for w in p_l]
            def grads(dx):  # the forward again, then its VJP: custom VJPs inside run here
                _, pull = jax.vjp(lambda x, p, r: layer(x, p, r, extras), x_l, p_l, r_l)
                return pull(dx)
            dx, dp, dr = snapshot.copy().run(grads, dx)
            a = [jax.lax.dynamic_update_index_in_dim(
                acc_, jax.lax.dynamic_index_in_dim(acc_, i, keepdims=False)
                + _scaled(d, slot.scale, acc_.dtype), i, 0) for acc_, d in zip(a, dp)]
            return (dx, a), dr

        (dx, a), dr = jax.lax.scan(back, (dy, a), (jnp.arange(n_layers), p, r, inputs),
                                   reverse=True)
        return None, dr, a, dx, None

    run.defvjp(run_fwd, run_bwd)
    return run(p_leaves, r_leaves, a_leaves, x, extras)
