"""One projection of the stacked decoder layer (common/block.py): its weight [layers, ...]
(nnx.Param), its einsum spec, its tensor-parallel role, and, when the run has them, its
fp8_delayed amax histories (ops.Fp8Meta) and its LoRA adapters (common/lora.py). The block
calls `self.wq(x)`; one input into several projections (q/k/v, gate/up) is
`Projection.shared(x, self.wq, self.wk, self.wv)`, which under a collective matmul shares one
ring. A new FP8 recipe or adapter kind is one more optional variable here and its role in
train/roles.py; the block does not change.

Stored flat. A block whose projections are modules (ProjectionOwner) lays their variables out
in its own state under the names they had as the block's bare attributes (`stored_name`):
`wq`, `fp8_wq`, `wq_lora_a`, `wq_lora_b`, not `wq/kernel`, `wq/fp8`, ... So the nnx.State
paths are those of before: the checkpoint's on-disk layout, the HF tables, the planner's and
the optimizer's path readers, and the compiled step (its parameters are named and ordered by
these paths) do not see the modules. This is the one place that maps the two.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from flax.nnx.graphlib import DataElem, StaticElem
from flax.nnx.pytreelib import PytreeState

from titanax import ops
from titanax.models.common.lora import adapter_delta, current_dropout, dropout_input, make_adapters
from titanax.ops.linear import linears

# A projection's variables (attribute -> its name in the owning block's state, as a format of
# the projection's name): the layout every checkpoint and path reader knows.
_STORED = {"kernel": "{}", "fp8": "fp8_{}", "lora_a": "{}_lora_a", "lora_b": "{}_lora_b"}
_STATIC_KEY = "_projection_{}"  # the owner's graphdef entry for a projection's static fields


def stored_name(projection: str, attr: str) -> str:
    """The block-state name of a projection's variable: ('wq', 'lora_a') -> 'wq_lora_a'."""
    return _STORED[attr].format(projection)


class Projection(nnx.Module):
    """einsum(spec, x, W) for one layer's slice of W, in the compute dtype or an FP8 recipe
    (titanax.ops.linear), plus its LoRA adapter's scale * (x A) B when it has one.

    name: the weight's name in the block ('wq'); tp: 'column' or 'row' (Megatron tensor
    parallelism, parallel/rules.py: column-parallel weights gather the sequence-parallel
    input, row-parallel ones scatter their output, parallel/collective_matmul.py)."""

    # Absent unless the run has them (with_fp8, with_adapters).
    fp8 = None
    lora_a = lora_b = None
    lora_scale, lora_rate = 0.0, 0.0

    def __init__(self, name: str, kernel: nnx.Param, spec: str, tp: str | None, execution):
        self.name, self.spec, self.tp, self.execution = name, spec, tp, execution
        self.kernel = kernel

    def with_fp8(self, history: int) -> None:
        """fp8_delayed: this call site's amax histories [layers, 3, history]."""
        self.fp8 = ops.make_fp8_meta(self.kernel.shape[0], history)

    def with_adapters(self, key, axes: tuple[str, ...], lora) -> None:
        """LoRA adapters A, B of rank lora.rank (common/lora.py make_adapters); axes: the
        weight's logical axes. lora: the config's lora section (scale, dropout rate)."""
        self.lora_a, self.lora_b = make_adapters(key, self.kernel.shape, axes, self.spec,
                                                 lora.rank)
        self.lora_scale, self.lora_rate = lora.scale, lora.dropout

    def __call__(self, x):
        y = ops.linear(x, self.kernel[...], self.spec, fp8_meta=self._meta(), **self._options())
        return self._adapted(y, x)

    @staticmethod
    def shared(x, *projections: Projection) -> tuple:
        """Each projection of the one input x (same spec and role): under a collective matmul
        (parallel/collective_matmul.py) they share one ring."""
        first = projections[0]
        assert all(p.spec == first.spec and p.tp == first.tp for p in projections), projections
        ys = linears(x, [p.kernel[...] for p in projections], first.spec,
                     fp8_metas=[p._meta() for p in projections], **first._options())
        return tuple(p._adapted(y, x) for p, y in zip(projections, ys, strict=True))

    def _options(self) -> dict:
        ex = self.execution
        return {"precision": ex.matmul_precision, "dtype": jnp.dtype(ex.dtype),
                "grad_reduce": ex.grad_reduce_dtype,
                "mxfp8_scale_rounding": ex.mxfp8_scale_rounding, "tp": self.tp}

    def _meta(self):
        """This layer's amax histories as fp8_linear takes them (fp8_delayed), else None."""
        return None if self.fp8 is None else ops.fp8_meta_dict(self.fp8[...])

    def _adapted(self, y, x):
        """y (= x W) plus the adapter's scale * (x A) B, if there is one. Inside
        lora.dropout_context (a training pass with lora.dropout > 0) the adapter sees
        dropout(x), the base x."""
        if self.lora_a is None:
            return y
        drop = current_dropout()
        if drop is not None and self.lora_rate > 0:
            x = dropout_input(x, *drop, self.name, self.lora_rate)
        return y + adapter_delta(x, self.lora_a[...], self.lora_b[...], self.spec,
                                 self.lora_scale, y.dtype)


class ProjectionOwner(nnx.Module):
    """A module whose Projection attributes are stored flat in its state (module docstring):
    NNX's graph protocol (split, merge, update) sees their variables under `stored_name`s and
    their static fields as one static entry each. These are flax's graph-node hooks
    (nnx.Pytree._graph_node_*, flax 0.12); every state of the model is made by nnx.split or
    nnx.state, which use them (tests/test_projection.py checks the paths). The module's jax
    pytree view (jax.tree.* on the module object itself) still nests, and nothing uses it."""

    def _graph_node_flatten(self):
        nodes, node_type = super()._graph_node_flatten()
        flat = []
        for key, elem in nodes:
            projection = getattr(elem, "value", elem)
            if not isinstance(projection, Projection):
                flat.append((key, elem))
                continue
            fields = []
            for attr, value in vars(projection).items():
                if attr in _STORED:
                    flat.append((stored_name(key, attr), DataElem(value)))
                elif attr != "_pytree__state":
                    fields.append((attr, value))
            flat.append((_STATIC_KEY.format(key), StaticElem(tuple(sorted(fields)))))
        return sorted(flat, key=lambda item: item[0]), node_type

    def _graph_node_init(self, attributes):
        attributes = dict(attributes)
        for key in [k for k in attributes if k.startswith(_STATIC_KEY.format(""))]:
            name = key[len(_STATIC_KEY.format("")):]
            projection = Projection._graph_node_create_empty(Projection)
            variables = [(attr, attributes.pop(stored_name(name, attr))) for attr in _STORED
                         if stored_name(name, attr) in attributes]
            projection._graph_node_init([*attributes.pop(key), *variables,
                                         ("_pytree__state", PytreeState())])
            attributes[name] = projection
        super()._graph_node_init(attributes.items())

    def _stored(self, key):
        """(the projection, its attribute) stored under `key`, or (None, key)."""
        for name, projection in vars(self).items():
            if isinstance(projection, Projection):
                for attr in _STORED:
                    if stored_name(name, attr) == key:
                        return projection, attr
        return None, key

    def _graph_node_set_key(self, key, value):
        projection, attr = self._stored(key)
        target = super() if projection is None else projection
        target._graph_node_set_key(attr, value)

    def _graph_node_pop_key(self, key):
        projection, attr = self._stored(key)
        if projection is None:
            return super()._graph_node_pop_key(key)
        return projection._graph_node_pop_key(attr)


def projections(module: nnx.Module) -> list[Projection]:
    """The module's Projection attributes, in attribute order."""
    return [v for v in vars(module).values() if isinstance(v, Projection)]
