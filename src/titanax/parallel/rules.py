"""THE table: logical axis names (used by model code) -> mesh axes (pipeline, data, fsdp,
expert, context, tensor).

Parameters and activations get separate tables (as in levanter): FSDP shards parameters and
optimizer state along 'embed', while activations are sharded along 'batch' over both data and
fsdp. Tensor parallelism is Megatron-style: column-parallel wq/wk/wv/w_gate/w_up (heads, kv_heads,
mlp out features on 'tensor'), then row-parallel wo/w_down (same names as in features), with
sequence parallelism in the norm regions: the residual stream between them is 'norm_seq',
split along the sequence over 'tensor', so XLA turns each row-parallel all-reduce into a
reduce-scatter and gathers the sequence again before the next column matmul. Pipeline
parallelism puts the stacked layers' leading axis on 'pipeline' (parallel/pipeline.py runs the
stages). Context parallelism splits the sequence ('seq', and 'norm_seq' before 'tensor') over
'context' in a load-balanced order (parallel/context.py), and, as TorchTitan's FSDP over
dp_shard x cp, shards parameters over fsdp x context: every context rank sees other tokens of
the same rows, so its gradients are summed over 'context' anyway and the reduce-scatter costs
what the all-reduce would. Nothing outside this file names a mesh axis for a logical one.
"""

from __future__ import annotations

import contextlib
import math

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from titanax.config.parallel import BATCH_AXES

MESH_AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")

PARAM_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("layers", "pipeline"),  # stage s holds its consecutive layers [L/PP, ...]
    ("vocab", "tensor"),
    ("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("lora_rank", None),  # LoRA adapters' rank axis (small): the weight's other axes shard them
    # MoE: the experts axis of expert weights [L, E, ...], split over 'expert' (expert
    # parallelism: models/common/moe_ep.py), and the router's output axis [L, D, E].
    ("expert", "expert"),
    # Expert weights whose experts divide by expert x fsdp x context (expert_weight_axes):
    # FSDP splits the experts, and their D stays whole.
    ("expert_fsdp", ("expert", "fsdp", "context")),
    ("expert_embed", None),
    ("router_experts", None),
)

ACTIVATION_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # 'expert' splits the rows too: outside the experts an expert rank is a data-parallel one
    # (first, so that the experts' shard_map takes its share of the rows without a reshuffle).
    ("batch", BATCH_AXES),
    # The loss head after a gpipe/circular pipeline: each stage takes its own share of the
    # rows instead of every stage computing the output layer for all of them.
    ("loss_batch", ("expert", "data", "fsdp", "pipeline")),
    ("seq", "context"),  # in parallel/context.py's load-balanced order when context > 1
    ("norm_seq", ("context", "tensor")),  # sequence parallelism: residual stream and norms
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("layers", None),
    ("cache_seq", None),
    ("lora_rank", None),
    ("expert", None),
    ("expert_fsdp", None),
    ("expert_embed", None),
    ("router_experts", None),
)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_axes(spec: P) -> tuple[str, ...]:
    """Every mesh axis a PartitionSpec splits some dimension over, in order."""
    return tuple(a for entry in spec for a in _axes(entry))


def _to_spec(names: tuple[str | None, ...], rules, shape=None) -> P:
    """The PartitionSpec of logical `names`. Mesh axes the mesh in context lacks are left out
    (a mesh built without 'context' still works); with `shape`, so are trailing axes of a rule
    whose product does not divide that dimension (a decode step's one position cannot split
    over 'context')."""
    table = dict(rules)
    mesh = jax.sharding.get_abstract_mesh()
    present = None if mesh is None or mesh.empty else dict(mesh.shape)
    out = []
    for i, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in parallel/rules.py; add it to "
                           "both tables")
        axes = _axes(table[name])
        if present is not None:
            axes = tuple(a for a in axes if a in present)
            while shape is not None and axes and shape[i] % math.prod(present[a] for a in axes):
                axes = axes[:-1]
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def activation_spec(names: tuple[str | None, ...], shape=None) -> P:
    return _to_spec(names, ACTIVATION_RULES, shape)


def expert_specs(tokens_shape) -> tuple[P, P, P]:
    """How the experts' shard_map (models/common/moe_ep.py) splits its operands, so that each
    device dispatches only its own tokens: (tokens [B, S, ...]: rows as 'batch', sequence as
    'seq', each token whole; up projections [E, D, F]: experts as 'expert', width as 'mlp';
    the down projection [E, F, D] likewise). 'embed' is left out: FSDP gathers the experts'
    weights at the shard_map's edge as it gathers every weight for its use."""
    return (activation_spec(("batch", "seq", None), tokens_shape),
            _to_spec(("expert", None, "mlp"), PARAM_RULES),
            _to_spec(("expert", "mlp", None), PARAM_RULES))


def expert_weight_axes(axes: tuple[str, ...], n_experts: int) -> tuple[str, ...]:
    """The logical names an expert weight ([L, E, ...], `axes` naming E 'expert' and D
    'embed') is stored under on the mesh in context. FSDP splits its experts when they divide
    by expert x fsdp x context: a layer's slice is then gathered along its leading axis. Split
    along D instead (as every other weight, the fallback), XLA gathers a non-leading axis by
    keeping a D-major float32 copy of every layer's experts for the whole step (docs/moe.md).
    The bytes per device are the same either way."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return axes
    ways = math.prod(dict(mesh.shape).get(a, 1) for a in _axes(dict(PARAM_RULES)["expert_fsdp"]))
    if n_experts % ways:
        return axes
    rename = {"expert": "expert_fsdp", "embed": "expert_embed"}
    return tuple(rename.get(a, a) for a in axes)


def batch_input_spec() -> P:
    """How a step's [B, S] token ids, targets, positions and segment ids arrive: rows split as
    'batch', each row whole on its devices (the model puts a context-parallel sequence in its
    balanced order and splits it itself), so a process loads whole rows."""
    return activation_spec(("batch", None))


def shard_activation(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Constrains an activation's sharding by logical names; a no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return x
    return jax.lax.with_sharding_constraint(x, activation_spec(names, x.shape))


def batch_shards(name: str = "batch") -> int:
    """How many ways the activation rule `name` splits an axis on the mesh in context (1
    without one): e.g. the batch rows per device are B // batch_shards()."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    axes = _axes(dict(ACTIVATION_RULES)[name])
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
    rules = tuple((name, _present(entry, mesh)) for name, entry in PARAM_RULES)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield


def _present(entry, mesh):
    """A rule's mesh axes that `mesh` has (a mesh built without 'context' still works)."""
    axes = tuple(a for a in _axes(entry) if a in mesh.axis_names)
    return None if not axes else axes[0] if len(axes) == 1 else axes
