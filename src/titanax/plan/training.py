"""What the planner counts for the variables a run trains, by the role the abstract state's
optimizer moves (train/roles.py): FullTraining for Role.TRAINED (every weight differentiated
and updated), plan/lora.py's AdapterTraining for Role.ADAPTER (a frozen base and its
adapters). plan/state_shape.py picks one per config from the role table; the memory, compute
and communication models ask it and name neither.

Each gives: the state's rows per device (state_bytes) and the name of its gradient row; the
share of the base's weight gradients the backward computes (weight_gradients: 1, or 0 with a
frozen base); what the update and the data-parallel all-reduce run over
(optimized_per_device, gradient_groups); what FSDP reduce-scatters (fsdp_gradient_elems);
the pipeline schedules and host offload the config takes with it; and its own plan.json
entries and step FLOPs."""

from __future__ import annotations

import dataclasses

from titanax.config import Config, grad_accum_in_place_unsupported
from titanax.plan.param_layout import ParamSplit
from titanax.train.optim import update_rule


def weight_bytes(cfg: Config) -> int:
    """Bytes per weight in model.param_dtype. Taken from the config, not the abstract state's
    dtypes: the memory model counts every weight at it, an MoE's few float32 routing biases
    among bf16 weights included (the adapters' width is their leaves', plan/lora.py)."""
    return 4 if cfg.model.param_dtype == "float32" else 2


@dataclasses.dataclass(frozen=True)
class FullTraining:
    """Every weight trained: the optimizer's state and a float32 gradient for each."""
    weight_gradients = 1.0  # the base's weight gradients: all computed
    pipeline_schedules = ("gpipe", "1f1b")
    host_offload = True  # train.offload_optimizer / offload_params run with it
    adapter_params = 0
    gradient_row = "gradients"

    def offload_choices(self, options: tuple) -> tuple:
        """Of --search's host offload options (nothing offloaded first), those it takes."""
        return options

    def state_bytes(self, cfg: Config, deg: dict[str, int], p: ParamSplit
                    ) -> tuple[dict[str, float], dict[str, float]]:
        """Weights, the optimizer's moments and the gradient buffer: ({HBM}, {pinned host})
        per device; p: the weights' split."""
        t = cfg.train
        pbytes = weight_bytes(cfg)
        device, host = {}, {}
        weights = p.total * pbytes
        # The update rule's state (train/optim.py's table; AdamW: mu and nu in the param dtype).
        moments = p.total * update_rule(cfg).state_bytes(pbytes)
        grads = p.total * 4  # float32, reduce-scattered into this shard layer by layer
        if t.offload_params:  # the layers' master weights live on the host
            host["weights"] = p.layers * pbytes
            weights -= p.layers * pbytes
            if t.grad_accum == 1:  # and their gradients too, read a layer at a time
                host["gradients"] = p.layers * 4
                grads -= p.layers * 4
            # (with grad_accum the sum runs in place, on the device: models/accumulate.py)
        if t.offload_optimizer:
            host["optimizer"] = moments
            moments = 0.0
        device["weights"] = weights
        device["optimizer"] = moments
        # Accumulating in place (models/accumulate.py) the backward adds each layer's gradients
        # into the one running sum (a layer's fresh gradients are in the transient term). The
        # plain sum keeps the sum and the microbatch's fresh stacked buffer at once.
        plain = t.grad_accum != 1 and grad_accum_in_place_unsupported(cfg) is not None
        device["gradients"] = grads * (2 if plain else 1)
        return device, host

    def optimized_per_device(self, deg: dict[str, int], p: ParamSplit) -> float:
        """Elements the update and the gradient all-reduce run over on one device."""
        return p.total

    def gradient_groups(self, deg: dict[str, int], layout) -> dict[tuple[str, ...], float]:
        """{mesh axes a gradient is all-reduced over: elements per device}."""
        return layout.gradient_groups(deg)

    def fsdp_gradient_elems(self, deg: dict[str, int], fsdp_group_params: float) -> float:
        """Elements the FSDP group's gradient collectives move per device, counted as a
        reduce-scatter's: every weight's gradient, as the weights are gathered."""
        return fsdp_group_params

    def adapter_values_per_token(self, cfg: Config) -> float:
        """Values per token and layer adapters move in one forward: none."""
        return 0.0

    def step_flops_per_token(self, cfg: Config, n_no_embed: int) -> float:
        """The step's own FLOPs per token where they differ from the model formula: 0."""
        return 0.0

    def plan_json(self, cfg: Config, est) -> dict:
        return {}
