"""Parameters per device counted leaf by leaf: every parameter's shape and logical axis names
(from the model's own build under nnx.eval_shape: nothing allocated), each axis split over the
mesh axes parallel/rules.py's PARAM_RULES give its name.

The memory model's uniform split (every layer parameter over fsdp x context x tensor x
pipeline) is exact for a dense decoder but for its norm scales (about 1e-5 of it). A
mixture-of-experts model's parameters do not split alike: the experts' w_gate, w_up, w_down
[L, E, D, F] also over 'expert', the router [L, D, E] not over tensor. Its per-device count is
taken here, leaf by leaf (docs/moe.md, Planner).
"""

from __future__ import annotations

import dataclasses
import functools
import math

from titanax.config import ExecutionConfig, ModelConfig
from titanax.models.registry import model_spec
from titanax.parallel.rules import PARAM_RULES

_RULES = dict(PARAM_RULES)


@dataclasses.dataclass(frozen=True)
class ParamLeaf:
    path: tuple[str, ...]  # e.g. ('layers', 'w_gate')
    shape: tuple[int, ...]
    names: tuple[str | None, ...]  # logical axis names, one per dimension

    @property
    def stacked(self) -> bool:
        """A decoder-layer parameter ([layers, ...], over 'pipeline')."""
        return self.path[0] == "layers"


def mesh_axes_of(name: str | None) -> tuple[str, ...]:
    """The mesh axes PARAM_RULES splits the logical axis `name` over (() for none)."""
    entry = _RULES.get(name) if name is not None else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def ways(leaf: ParamLeaf, deg: dict[str, int], skip: tuple[str, ...] = ()) -> int:
    """How many ways the mesh of degrees `deg` splits the leaf (mesh axes in `skip` left
    whole: e.g. the FSDP group's, to count what it gathers)."""
    return math.prod(deg.get(a, 1) for name in leaf.names for a in mesh_axes_of(name)
                     if a not in skip)


def per_device(leaf: ParamLeaf, deg: dict[str, int], skip: tuple[str, ...] = ()) -> float:
    return math.prod(leaf.shape) / ways(leaf, deg, skip)


@functools.lru_cache(maxsize=16)
def param_leaves(model: ModelConfig) -> tuple[ParamLeaf, ...]:
    """Every parameter of the model (nnx.Param; FP8 scaling state is not one), from the
    architecture's build as ModelSpec.count_params sees it."""
    from flax import nnx

    from titanax.parallel.mesh import single_device_mesh
    from titanax.parallel.rules import model_context

    spec = model_spec(model)
    with model_context(single_device_mesh()):
        abstract = nnx.eval_shape(lambda: spec.build(model, ExecutionConfig(),
                                                     rngs=nnx.Rngs(0)))
    return tuple(ParamLeaf(tuple(str(p) for p in path), tuple(v.shape),
                           tuple(v.get_metadata()["out_sharding"]))
                 for path, v in nnx.to_flat_state(nnx.state(abstract, nnx.Param)))


def exact_split(model: ModelConfig, deg: dict[str, int]) -> tuple[float, float, float]:
    """(decoder-layer parameters per device, the other parameters per device, one layer's
    parameters with the FSDP group's axes whole: what one layer's gathers hold)."""
    leaves = param_leaves(model)
    layers = sum(per_device(x, deg) for x in leaves if x.stacked)
    other = sum(per_device(x, deg) for x in leaves if not x.stacked)
    fsdp_group = fsdp_group_axes()
    one_layer = sum(per_device(x, deg, fsdp_group + mesh_axes_of("layers"))
                    for x in leaves if x.stacked) / model.n_layers
    return layers, other, one_layer


def fsdp_group_axes() -> tuple[str, ...]:
    """The mesh axes FSDP shards (and gathers) parameters over: those of 'embed'."""
    return mesh_axes_of("embed")


def fsdp_gathered(model: ModelConfig, deg: dict[str, int]) -> float:
    """Parameters one device's FSDP group gathers whole for a forward: every leaf split over
    the group, at its size over the other mesh axes (the experts over 'expert' too)."""
    group = fsdp_group_axes()
    return sum(per_device(x, deg, group) for x in param_leaves(model)
               if any(a in group for n in x.names for a in mesh_axes_of(n)))


def replicas_of(leaf: ParamLeaf, replica_axes: tuple[str, ...]) -> tuple[str, ...]:
    """Of the mesh axes that hold other rows of the batch beside the FSDP group's (data, and
    expert for a mixture of experts), those the leaf is whole over: its gradient is summed
    over them (the experts' weights are split over 'expert', so theirs is not)."""
    split = {a for n in leaf.names for a in mesh_axes_of(n)}
    return tuple(a for a in replica_axes if a not in split)


def grads_by_replica_group(model: ModelConfig, deg: dict[str, int],
                           replica_axes: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """{mesh axes a gradient is all-reduced over: parameters per device reduced over them}."""
    out: dict[tuple[str, ...], float] = {}
    for leaf in param_leaves(model):
        group = replicas_of(leaf, replica_axes)
        out[group] = out.get(group, 0.0) + per_device(leaf, deg)
    return out
