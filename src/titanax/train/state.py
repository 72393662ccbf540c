"""The train state: a typed pytree (TrainState) whose variables are grouped by role, created
sharded on device (the init function is jitted with out_shardings from the variables' logical
axes, so no host ever holds the full weights). Circular pipeline runs store the layer stack
stage-major (parallel/pipeline.py); the permutation happens here, once.

Roles (one table, train/roles.py `roles_for`: variable type -> role):

    variable type              role        the step                       opt_state
    nnx.Param (no LoRA)        trained     differentiates, optimizer      its moments
    nnx.Param (LoRA: the base) frozen      a constant of the loss         -
    LoRA (lora.rank > 0)       adapter     differentiates, optimizer      its moments
    ops.Fp8Meta (fp8_delayed)  statistic   its rule (the VJP's histories) -
    + trained leaves the spec's `self_updated` selects (an MoE's routing bias): statistics too,
      kept where they live in the param tree (checkpoint layout), zeroed out of the gradients
      and set by their rule (train/self_updated.py)

No other module names the state's entries: they use TrainState's fields and roles. The only
string keys are the checkpoint's on-disk layout ({'step', 'params'[, 'lora'][, 'fp8'],
'opt_state'}, unchanged so every saved step resumes): `to_saved` / `from_saved` convert at the
boundary where the checkpoint manager is called."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from titanax.config import Config
from titanax.models.spec import ModelSpec
from titanax.parallel.layer_order import to_storage_order
from titanax.parallel.mesh import check_layout
from titanax.parallel.rules import batch_input_spec, model_context
from titanax.train import offload
from titanax.train.resolved import resolve
from titanax.train.roles import OPTIMIZED, Role, Roles, roles_for

# The checkpoint's on-disk layout: each role's entry name (the weights are 'params' whether
# trained or frozen), the step counter's and the optimizer state's.
_SAVED_NAME = {Role.TRAINED: "params", Role.FROZEN: "params", Role.ADAPTER: "lora",
               Role.STATISTIC: "fp8"}
_STEP, _OPT_STATE = "step", "opt_state"


@dataclasses.dataclass(frozen=True)
class TrainState:
    """step (int32 scalar), variables (role -> nnx.State, only the roles the model has
    variables of), opt_state (the optimizer's state of the trained role's variables; None
    while a LoRA run starting from a base has no adapters yet). A pytree: the same structure
    of NamedShardings (or ShapeDtypeStructs) is the state's shardings (abstract state)."""
    step: Any
    variables: Mapping[Role, Any]
    opt_state: Any = None

    def __post_init__(self):  # one order of the groups (Role's), however the state was built
        object.__setattr__(self, "variables",
                           {r: self.variables[r] for r in Role if r in self.variables})

    def group(self, role: Role):
        """The variables of `role`, or None."""
        return self.variables.get(role)

    @property
    def trained(self):
        """The variables the step differentiates and the optimizer moves."""
        return next((self.variables[r] for r in OPTIMIZED if r in self.variables), None)

    @property
    def trained_role(self) -> Role | None:
        return next((r for r in OPTIMIZED if r in self.variables), None)

    @property
    def weights_role(self) -> Role:
        """The weights' (nnx.Param's) role: frozen under LoRA, else trained."""
        return Role.FROZEN if Role.FROZEN in self.variables else Role.TRAINED

    @property
    def weights(self):
        """The model's weights (nnx.Param), trained or frozen."""
        return self.variables.get(self.weights_role)

    @property
    def adapters(self):
        return self.variables.get(Role.ADAPTER)

    @property
    def statistics(self):
        return self.variables.get(Role.STATISTIC)

    def model_variables(self) -> tuple:
        """Every variable group, for nnx.merge(graphdef, *them): the model, adapters and
        statistics included."""
        return tuple(self.variables.values())

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)

    def with_group(self, role: Role, value) -> TrainState:
        return self.replace(variables={**self.variables, role: value})

    def to_saved(self) -> dict:
        """The dict the checkpoint stores (its on-disk layout)."""
        out = {_STEP: self.step, **{_SAVED_NAME[r]: v for r, v in self.variables.items()}}
        if self.opt_state is not None:
            out[_OPT_STATE] = self.opt_state
        return out

    @classmethod
    def from_saved(cls, saved: Mapping, roles: Roles | None = None) -> TrainState:
        """The state a checkpoint's dict holds. roles: the run's (its weights are frozen
        under LoRA); None: inferred from the dict (frozen when it holds adapters)."""
        frozen = (roles.trains is Role.ADAPTER if roles is not None
                  else _SAVED_NAME[Role.ADAPTER] in saved)
        order = (Role.FROZEN if frozen else Role.TRAINED, Role.ADAPTER, Role.STATISTIC)
        variables = {r: saved[_SAVED_NAME[r]] for r in order if _SAVED_NAME[r] in saved}
        return cls(saved[_STEP], variables, saved.get(_OPT_STATE))

    # --- pytree: flattened in the order of the on-disk names, keyed by them, as the state's
    # former dict form was: the compiled step's parameters and their names (its HLO text),
    # and the key paths messages print, are unchanged.
    def _entries(self):
        entries = [(_SAVED_NAME[r], r, v) for r, v in self.variables.items()]
        entries += [(_STEP, _STEP, self.step), (_OPT_STATE, _OPT_STATE, self.opt_state)]
        return sorted(entries, key=lambda e: e[0])

    def _flatten_with_keys(self):
        entries = self._entries()
        keys = [jax.tree_util.DictKey(name) for name, _, _ in entries]
        return (list(zip(keys, (v for *_, v in entries), strict=True)),
                tuple(w for _, w, _ in entries))

    def _flatten(self):
        entries = self._entries()
        return [v for *_, v in entries], tuple(w for _, w, _ in entries)

    @classmethod
    def _unflatten(cls, which, children):
        by = dict(zip(which, children, strict=True))
        return cls(by[_STEP], {r: by[r] for r in Role if r in by}, by[_OPT_STATE])


jax.tree_util.register_pytree_with_keys(
    TrainState, TrainState._flatten_with_keys, TrainState._unflatten, TrainState._flatten)


def _state_shardings(abstract_state, mesh):
    """NamedShardings for a state pytree whose Variables carry logical names (params, and the
    optimizer moments that mirror them); everything else (step, counters) is replicated."""
    specs = nnx.get_partition_spec(abstract_state)
    return jax.tree.map(lambda s: NamedSharding(mesh, s if isinstance(s, P) else P()), specs,
                        is_leaf=lambda x: isinstance(x, P) or x is None)


def _split_model(cfg: Config, roles: Roles, spec: ModelSpec, stages: int, virtual: int):
    """(graphdef, {role: variables}) of a freshly initialised model, the stacked leaves in
    storage order. Split by type, exhaustive: any state of another type is an error here;
    roles without variables (no LoRA, no fp8_delayed) are left out."""
    model = spec.build(cfg.model, cfg.execution, rngs=nnx.Rngs(params=cfg.train.seed),
                       lora=cfg.lora)
    graphdef, *groups = nnx.split(model, *roles.types)
    variables = {}
    for (_, role), group in zip(roles.by_type, groups, strict=True):
        if role in (Role.TRAINED, Role.FROZEN) or jax.tree.leaves(group):
            # The same logical weights whatever the layout; only their order in the stack
            # differs (adapters and histories are stacked like the layers they belong to).
            group["layers"] = to_storage_order(group["layers"], stages, virtual)
            variables[role] = group
    return graphdef, variables


def _make_init(cfg: Config, tx: optax.GradientTransformation, mesh, roles: Roles,
               spec: ModelSpec):
    """init() -> (graphdef, TrainState); the graphdef is a pytree without leaves, so
    jax.eval_shape returns it as it is (no side channel)."""
    stages, virtual = mesh.shape["pipeline"], cfg.pipeline.resolved_virtual_stages

    def init():
        graphdef, variables = _split_model(cfg, roles, spec, stages, virtual)
        # The optimizer sees the trained role's variables alone (LoRA: the adapters).
        state = TrainState(jnp.zeros((), jnp.int32), variables, tx.init(variables[roles.trains]))
        return graphdef, state

    return init


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What one jax.eval_shape of the init gives: the graphdef, the abstract state (leaves
    ShapeDtypeStructs carrying their shardings), the shardings (a TrainState of
    NamedShardings), the role table and the model's spec."""
    graphdef: Any
    abstract: TrainState
    shardings: TrainState
    roles: Roles
    spec: ModelSpec

    def __iter__(self):  # (graphdef, abstract, shardings), as abstract_train_state returned
        return iter((self.graphdef, self.abstract, self.shardings))


def state_layout(cfg: Config, mesh, tx, *, spec: ModelSpec | None = None) -> StateLayout:
    """The state's layout without allocating anything: one jax.eval_shape of the init. Checks
    the model and batch against the mesh first (ConfigError naming the fix). The leaves that
    train.offload_* put in host memory have memory_kind 'pinned_host' (so the state is
    created there, and checkpoints restore there). spec: cfg.model's, as the entry resolved
    it (train/resolved.py); resolved here for a caller that holds only the config."""
    check_layout(cfg, mesh)
    spec = spec or resolve(cfg).spec
    roles = roles_for(cfg, spec)
    with model_context(mesh):
        graphdef, abstract = jax.eval_shape(_make_init(cfg, tx, mesh, roles, spec))
        shardings = _state_shardings(abstract, mesh)
    # (outside the mesh: optax runs tx.init eagerly to find the moments, on no device of it)
    shardings = offload.place_state(cfg, tx, shardings)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    return StateLayout(graphdef, abstract, shardings, roles, spec)


def abstract_train_state(cfg: Config, mesh, tx, *, spec: ModelSpec | None = None):
    """(graphdef, abstract state with shardings, shardings): state_layout's."""
    return tuple(state_layout(cfg, mesh, tx, spec=spec))


def init_train_state(cfg: Config, mesh, tx, layout: StateLayout) -> TrainState:
    """The state of `layout` (state_layout's) initialised on device, as its shardings say."""
    init = _make_init(cfg, tx, mesh, layout.roles, layout.spec)
    with model_context(mesh):
        return jax.jit(lambda: init()[1], out_shardings=layout.shardings)()


def create_train_state(cfg: Config, mesh, tx, *, spec: ModelSpec | None = None):
    """(graphdef, state, shardings) on device: a TrainState (module docstring for the roles)
    and its shardings."""
    layout = state_layout(cfg, mesh, tx, spec=spec)
    return layout.graphdef, init_train_state(cfg, mesh, tx, layout), layout.shardings


def with_fresh_adapters(cfg: Config, mesh, tx, state: TrainState,
                        layout: StateLayout) -> TrainState:
    """state (restored from a checkpoint saved without LoRA: step, weights[, statistics]) with
    new adapters (B = 0: the model computes what the base does) and a fresh optimizer state
    for them: how a LoRA run starts from an imported model. Jitted with only those as
    outputs, so the model's fresh base weights are never materialised (dead code)."""
    init = _make_init(cfg, tx, mesh, layout.roles, layout.spec)
    fresh = (layout.shardings.adapters, layout.shardings.opt_state)
    with model_context(mesh):
        adapters, opt_state = jax.jit(lambda: (lambda s: (s.adapters, s.opt_state))(init()[1]),
                                      out_shardings=fresh)()
    return state.with_group(Role.ADAPTER, adapters).replace(opt_state=opt_state)


def needs_fresh_adapters(abstract: TrainState, state: TrainState) -> bool:
    """A LoRA run (its abstract state has adapters) restored from a step without them."""
    return abstract.adapters is not None and state.adapters is None


def restored_state(saved: Mapping, roles: Roles, shardings: TrainState, reorder) -> TrainState:
    """The TrainState of a checkpoint's dict: reorder(saved, shardings of its entries) puts
    its stacked leaves into this run's layer order (parallel/layer_order.reorder_restored)."""
    by_name = shardings.to_saved()
    saved = reorder(saved, {k: by_name[k] for k in saved})
    return TrainState.from_saved(saved, roles)


def jit_train_step(cfg: Config, mesh, graphdef, shardings, tx, schedule, *,
                   spec: ModelSpec | None = None, roles: Roles | None = None):
    """The train step jitted as the loop runs it: state and batch sharded, state donated.
    spec, roles: the run's (state_layout's), as make_train_step takes them."""
    from titanax.train.step import make_train_step

    batch_sharding = NamedSharding(mesh, batch_input_spec())
    return jax.jit(make_train_step(cfg, graphdef, tx, schedule, spec=spec, roles=roles),
                   in_shardings=(shardings, batch_sharding), out_shardings=(shardings, None),
                   donate_argnums=(0,))


def jit_eval_step(cfg: Config, mesh, graphdef, shardings: TrainState):
    """eval_fn(state, batch) -> (summed NLL, token count): the eval step jitted as the loop
    runs it, on all of the state's variables (the weights; under fp8_delayed the amax
    histories, which scale the forward pass's FP8 casts; with LoRA the adapters). The
    optimizer state is not an input. Nothing is donated."""
    from titanax.train.step import make_eval_step

    batch_sharding = NamedSharding(mesh, batch_input_spec())
    fn = jax.jit(make_eval_step(cfg, graphdef),
                 in_shardings=(shardings.model_variables(), batch_sharding))
    return lambda state, batch: fn(state.model_variables(), batch)


def fresh_statistics(abstract_state: TrainState) -> dict:
    """{Role.STATISTIC: the statistics (fp8_delayed's amax histories) at zero, as a new run
    starts them}, or {} when the model has none: for code that builds a train state around
    other weights (HF import)."""
    stats = abstract_state.statistics
    if stats is None:
        return {}
    return {Role.STATISTIC: jax.tree.map(
        lambda a: jnp.zeros(a.shape, a.dtype, device=a.sharding), stats)}


def trainable_count(state: TrainState, roles: Roles) -> int:
    """The values the optimizer trains: the trained role's, less the self-updated leaves
    (an MoE's routing bias, moved by its own rule)."""
    from titanax.train.optim import param_names

    own = roles.self_updated
    return sum(int(x.size) for path, x in jax.tree_util.tree_leaves_with_path(state.trained)
               if own is None or not own.selects(param_names(path)))
