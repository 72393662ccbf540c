"""How a role's variables split over the mesh, per device (plan/state_shape.py reads them from
the abstract state: every variable's shape and logical axis names, each axis split over the
mesh axes parallel/rules.py's PARAM_RULES give its name).

Two layouts of the weights, chosen by the architecture (models/spec.py
PlannerTerms.params_split_alike): a dense decoder's every layer parameter splits alike (over
fsdp x context x tensor x pipeline), so its count splits uniformly (UniformLayout: exact but
for the norm scales, about 1e-5 of it); a mixture of experts' do not (the experts' w_gate,
w_up, w_down [L, E, D, F] also over 'expert', the router [L, D, E] not over tensor), so they
are counted leaf by leaf (LeafLayout; docs/moe.md, Planner).
"""

from __future__ import annotations

import dataclasses
import math

from titanax.parallel.rules import PARAM_RULES
from titanax.plan.step_shape import activation_axes

_RULES = dict(PARAM_RULES)


@dataclasses.dataclass(frozen=True)
class ParamLeaf:
    path: tuple[str, ...]  # e.g. ('layers', 'w_gate')
    shape: tuple[int, ...]
    names: tuple[str | None, ...]  # logical axis names, one per dimension
    itemsize: int  # bytes per element of its dtype

    @property
    def stacked(self) -> bool:
        """A decoder-layer variable ([layers, ...], over 'pipeline')."""
        return self.names[0] == "layers"

    @property
    def size(self) -> int:
        return math.prod(self.shape)


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


def fsdp_group_axes() -> tuple[str, ...]:
    """The mesh axes FSDP shards (and gathers) parameters over: those of 'embed'."""
    return mesh_axes_of("embed")


def param_shards(deg: dict[str, int]) -> int:
    """The FSDP group: parameters are sharded (and gathered) over fsdp x context, because the
    context ranks of a row hold other tokens of it and sum their gradients anyway."""
    return deg["fsdp"] * deg.get("context", 1)


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """Parameters per device: the stacked decoder layers (sharded over fsdp x context, tensor
    and pipeline; an MoE's experts over expert too) and the rest (embedding, output layer,
    final norm: fsdp x context and tensor only; every pipeline stage holds them)."""
    layers: float
    other: float
    one_layer: float  # one decoder layer's parameters over tensor (what FSDP gathers)

    @property
    def total(self) -> float:
        return self.layers + self.other


@dataclasses.dataclass(frozen=True)
class UniformLayout:
    """A dense decoder's weights: n_params split uniformly (module docstring)."""
    model: object  # the model section (ModelConfig)
    n_params: int

    def split(self, deg: dict[str, int]) -> ParamSplit:
        m = self.model
        tp, shards, pp = deg["tensor"], param_shards(deg), deg["pipeline"]
        # the parameters outside the layer stack: embedding, output layer (none when tied),
        # norm
        other = (1 if m.tie_embeddings else 2) * m.vocab_size * m.d_model + m.d_model
        layers = self.n_params - other
        return ParamSplit(layers / (shards * tp * pp), other / (shards * tp),
                          layers / m.n_layers / tp)

    def fsdp_gathered(self, deg: dict[str, int]) -> float:
        """Parameters one device's FSDP group gathers whole for a forward."""
        return self.n_params / (deg["tensor"] * deg["pipeline"])

    def gradient_groups(self, deg: dict[str, int]) -> dict[tuple[str, ...], float]:
        """{mesh axes a gradient is all-reduced over: parameters per device reduced over
        them}: every weight is whole over 'data'."""
        return {("data",): self.split(deg).total}


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """Weights split unalike, counted leaf by leaf (module docstring)."""
    leaves: tuple[ParamLeaf, ...]
    n_layers: int

    def split(self, deg: dict[str, int]) -> ParamSplit:
        """Decoder-layer parameters per device, the others, and one layer's with the FSDP
        group's axes whole (what one layer's gathers hold)."""
        layers = sum(per_device(x, deg) for x in self.leaves if x.stacked)
        other = sum(per_device(x, deg) for x in self.leaves if not x.stacked)
        whole = fsdp_group_axes() + mesh_axes_of("layers")
        one_layer = sum(per_device(x, deg, whole)
                        for x in self.leaves if x.stacked) / self.n_layers
        return ParamSplit(layers, other, one_layer)

    def fsdp_gathered(self, deg: dict[str, int]) -> float:
        """Every leaf split over the FSDP group, at its size over the other mesh axes (the
        experts over 'expert' too)."""
        group = fsdp_group_axes()
        return sum(per_device(x, deg, group) for x in self.leaves
                   if any(a in group for n in x.names for a in mesh_axes_of(n)))

    def gradient_groups(self, deg: dict[str, int]) -> dict[tuple[str, ...], float]:
        """Each gradient summed over the batch axes beside the FSDP group's (data, and expert)
        that its parameter is whole over (the experts' weights are split over 'expert', so
        theirs is not)."""
        replica_axes = tuple(a for a in activation_axes("batch") if a not in fsdp_group_axes())
        out: dict[tuple[str, ...], float] = {}
        for leaf in self.leaves:
            split = {a for n in leaf.names for a in mesh_axes_of(n)}
            group = tuple(a for a in replica_axes if a not in split)
            out[group] = out.get(group, 0.0) + per_device(leaf, deg)
        return out
