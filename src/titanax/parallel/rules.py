"""THE table: logical axis names (used by model code) -> mesh axes (pipeline, data, fsdp, tensor).

Parameters and activations get separate tables (as in levanter): FSDP shards parameters and
optimizer state along 'embed', while activations are sharded along 'batch' over both data and
fsdp. Tensor parallelism is Megatron-style: column-parallel wq/wk/wv/w_gate/w_up (heads, kv_heads,
mlp out features on 'tensor'), then row-parallel wo/w_down (same names as in features), with
sequence parallelism in the norm regions: the residual stream between them is 'norm_seq',
split along the sequence over 'tensor', so XLA turns each row-parallel all-reduce into a
reduce-scatter and gathers the sequence again before the next column matmul. Pipeline
parallelism puts the stacked layers' leading axis on 'pipeline' (parallel/pipeline.py runs the
stages). Nothing outside this file names a mesh axis for a logical one.
"""

from __future__ import annotations

import contextlib

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

MESH_AXES = ("pipeline", "data", "fsdp", "tensor")

PARAM_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("layers", "pipeline"),  # stage s holds its consecutive layers [L/PP, ...]
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
)

ACTIVATION_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    # The loss head after a gpipe/circular pipeline: each stage takes its own share of the
    # rows instead of every stage computing the output layer for all of them.
    ("loss_batch", ("data", "fsdp", "pipeline")),
    ("seq", None),
    ("norm_seq", "tensor"),  # sequence parallelism: residual stream and norms
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("cache_seq", None),
)


def _to_spec(names: tuple[str | None, ...], rules) -> P:
    table = dict(rules)
    out = []
    for name in names:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in parallel/rules.py; add it to "
                           "both tables")
        out.append(table[name])
    return P(*out)


def activation_spec(names: tuple[str | None, ...]) -> P:
    return _to_spec(names, ACTIVATION_RULES)


def shard_activation(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Constrains an activation's sharding by logical names; a no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, activation_spec(names))


def batch_shards(name: str = "batch") -> int:
    """How many ways the activation rule `name` splits an axis on the mesh in context (1
    without one): e.g. the batch rows per device are B // batch_shards()."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    axes = dict(ACTIVATION_RULES)[name]
    axes = (axes,) if isinstance(axes, str) else axes or ()
    n = 1
    for a in axes:
        n *= mesh.shape.get(a, 1)
    return n


def loss_rows(batch: int) -> str:
    """'loss_batch' when `batch` rows split over data x fsdp x pipeline (the loss then runs on
    each pipeline stage's share), else 'batch'."""
    return "loss_batch" if batch % batch_shards("loss_batch") == 0 else "batch"


@contextlib.contextmanager
def model_context(mesh: jax.sharding.Mesh):
    """Everything model creation needs: the mesh set, and the parameter rules active."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(PARAM_RULES):
        yield
