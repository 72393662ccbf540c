"""What the rest of titanax asks of a model architecture: one ModelSpec per folder under
models/ (its spec.py), registered by name in titanax/archs.py and chosen by `model.arch`.

State creation, the train loop, sampling, HF import/export, the planner and the FLOP formula
ask the spec; none of them imports a model class. Hooks (flops, activation_elems, aux_losses,
no_decay, legacy_transposes, self_updated, planner) default to what a dense decoder needs; an
architecture overrides the ones it differs in."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from titanax.config import ExecutionConfig, ModelConfig

FLOP_FORMULA = ("FLOPs/token = 6*N + 12*L*d*S (N: params without input embedding; "
                "d: attention width n_heads*head_dim, = d_model for Llama)")


def flops_per_token(model: ModelConfig, seq_len: int, n_params_no_embed: int) -> float:
    """6*N + 12*L*d*S: N the parameters without the input embedding (the output layer counts),
    the second term attention's score and value matmuls forward and backward, causal mask not
    discounted (as NVIDIA and MaxText report MFU); d = n_heads * head_dim (d_model in Llama)."""
    width = model.n_heads * model.resolved_head_dim
    return 6.0 * n_params_no_embed + 12.0 * model.n_layers * width * seq_len


def no_decay_norms(path: tuple[str, ...]) -> bool:
    """The default no-decay rule: norm scales (any path with 'norm' in a name) get no weight
    decay, every other parameter does."""
    return any("norm" in name for name in path)


def no_legacy_layouts(model: ModelConfig) -> dict:
    """The default migration table: every checkpoint of the architecture is in its current
    layout."""
    return {}


def no_aux_losses(model) -> dict:
    """The default auxiliary losses: none (a dense model's loss is its token NLL alone)."""
    return {}


# The aux_losses term that carries a statistic to SelfUpdated parameters: of value 0, its
# derivative with respect to them is the statistic. train/step.py adds it to the loss as it
# is (never weighted by a microbatch's token share, so microbatches add their statistics) and
# does not log it.
PROBE = "statistic_probe"


@dataclasses.dataclass(frozen=True)
class SelfUpdated:
    """Parameters the optimizer does not train (an MoE's DeepSeek-V3 routing bias): their
    gradient is a statistic of the step (summed over microbatches and devices as gradients
    are), which the train step takes out before the optimizer (so it is in neither the
    gradient norm nor the clipping) and turns into their new value."""
    # path like ('layers', 'router_bias') -> is one of them
    selects: Callable[[tuple[str, ...]], bool]
    # (value, its statistic) -> the new value, both float32 arrays of the parameter's shape
    update: Callable[[Any, Any], Any]
    # What they are and what a model without them does differently, for messages (an HF
    # export whose format has no tensor for them: hf/exporter.py).
    what: str = "parameters the train step sets by a rule of their own"
    lost_effect: str = "compute differently"


def no_self_updated(model: ModelConfig) -> None:
    """The default: every parameter is the optimizer's."""
    return None


@dataclasses.dataclass(frozen=True)
class PlannerTerms:
    """What the planner (plan/) asks of an architecture beyond its parameters' shapes, which
    it reads from the abstract state: a dense decoder's answers here; a mixture of experts'
    in models/common/moe_plan.py. `cfg` is the run's Config, `shape` plan/step_shape.StepShape
    (deg: mesh degrees, tokens_pipe_micro: a device's tokens of one (accumulation, pipeline)
    microbatch, act_bytes: the compute dtype's width); models/ imports no plan module."""
    # Every decoder-layer parameter splits over the same mesh axes (fsdp x context, tensor,
    # pipeline), so the planner splits their count uniformly (exact but for the norm scales,
    # about 1e-5 of it); False: leaf by leaf as parallel/rules.py splits each
    # (plan/param_layout.py).
    params_split_alike: bool = True

    def active_params(self, cfg, n_no_embed: int) -> int:
        """The parameters (without the input embedding) a token runs through: all of them."""
        return n_no_embed

    def ffn_elementwise_values(self, cfg) -> float:
        """Values per token and layer one forward of the feed-forward moves besides its
        GEMMs: SwiGLU on 3 ffn_dim."""
        return 3 * cfg.model.ffn_dim

    def dispatch(self, cfg, shape):
        """The layer's exchange of tokens between devices (an object with ep, buffer_bytes,
        ids_bytes, sent_share, all_to_alls(recomputes) and to_json()), or None: none."""
        return None

    def layer_transient_bytes(self, cfg, shape, one_layer: float) -> float | None:
        """One layer's backward transient per device (one_layer: one layer's parameters as
        the FSDP group gathers them); None: the planner's dense decoder formula
        (plan/memory_model.py)."""
        return None

    def plan_json(self) -> dict:
        """Entries plan.json adds beside the numbers (what the model leaves out)."""
        return {}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    arch: str  # the model.arch value
    # The model section's class (a frozen ModelConfig subclass in the folder's config.py, which
    # imports no jax): the architecture's fields, compared whole when a checkpoint resumes.
    config: type[ModelConfig]
    # build(cfg, execution, rngs) -> an nnx.Module (cfg: the model section, execution: the
    # ExecutionConfig) with __call__(tokens_BS, positions_BS, segment_ids_BS,
    # cache, cache_index, pipeline) -> (logits_BSV, cache) and loss_sum(tokens_BS, targets_BS,
    # positions_BS, segment_ids_BS, *, pipeline, loss_chunk) -> float32 sum of token NLLs.
    build: Callable[..., Any]
    # init_cache(cfg, batch, max_len, dtype) -> the KV cache __call__ takes
    init_cache: Callable[..., Any]
    presets: Mapping[str, dict]  # preset name -> ModelConfig fields
    # The model's HF interop (models/common/hf_interop.HFInterop: tensor table, config.json both ways);
    # None: the architecture cannot be imported or exported.
    hf: Any = None
    # --- hooks, each defaulting to what a dense decoder needs ---------------------------
    # flops(cfg, seq_len, n_params_no_embed) -> FLOPs per token trained; an MoE counts its
    # active parameters here instead of all of them.
    flops: Callable[[ModelConfig, int, int], float] = flops_per_token
    # activation_elems(cfg, remat) -> saved activation elements per token per layer for the
    # planner's memory model; None: the planner's generic decoder formula
    # (plan/memory_model.py saved_elems_per_token).
    activation_elems: Callable[[ModelConfig, str], float] | None = None
    # aux_losses(model) -> {name: float32 scalar} of extra loss terms (e.g. an MoE's load
    # balancing), each a mean over the batch, already weighted: train/step.py adds them to
    # the step's mean token NLL (a microbatch its token share); read from the model after
    # its forward pass (values it sowed); {} for a dense model.
    aux_losses: Callable[[Any], Mapping[str, Any]] = no_aux_losses
    # aux_metrics(model) -> {name: float32 scalar} logged with the step's metrics as
    # 'aux/<name>' (with the aux_losses terms), not part of the loss: e.g. an MoE's routing
    # statistics; read like aux_losses.
    aux_metrics: Callable[[Any], Mapping[str, Any]] = no_aux_losses
    # no_decay(path) -> True for a parameter (path like ('layers', 'attn_norm', 'scale'))
    # that gets no weight decay.
    no_decay: Callable[[tuple[str, ...]], bool] = no_decay_norms
    # legacy_transposes(cfg) -> {name under 'layers': (perm, current shape)} of parameters an
    # older titanax stored in another layout (checkpoint/migrations.py applies them on restore).
    legacy_transposes: Callable[[ModelConfig], Mapping[str, tuple]] = no_legacy_layouts
    # self_updated(cfg) -> a SelfUpdated (parameters updated from a statistic, not by the
    # optimizer) or None.
    self_updated: Callable[[ModelConfig], SelfUpdated | None] = no_self_updated
    # the planner's architecture terms (PlannerTerms above)
    planner: PlannerTerms = PlannerTerms()

    def count_params(self, cfg: ModelConfig, *, exclude_embedding: bool = False) -> int:
        """Exact parameter count from nnx.eval_shape: nothing is allocated. FP8 scaling state is
        not a parameter. exclude_embedding: without the input embedding (tied embeddings count
        once, as the output layer)."""
        import jax
        from flax import nnx

        from titanax.parallel.mesh import single_device_mesh
        from titanax.parallel.rules import model_context

        with model_context(single_device_mesh()):
            abstract = nnx.eval_shape(lambda: self.build(cfg, ExecutionConfig(), rngs=nnx.Rngs(0)))
        state = nnx.state(abstract, nnx.Param)  # (ops.Fp8Meta is a Variable of its own)
        total = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
        if exclude_embedding and not getattr(cfg, "tie_embeddings", False):
            total -= cfg.vocab_size * cfg.d_model
        return total

    def param_shapes(self, cfg: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
        """{path like ('layers', 'wq'): shape} of every parameter as a checkpoint of cfg
        stores it (stacked [L, ...]; an MoE's experts [L, E, ...]), from nnx.eval_shape of
        build: nothing is allocated, and no caller needs to know the architecture's fields
        (hf/exporter.py checks a step against it)."""
        import jax
        from flax import nnx

        from titanax.parallel.mesh import single_device_mesh
        from titanax.parallel.rules import model_context

        with model_context(single_device_mesh()):
            model = nnx.eval_shape(lambda: self.build(cfg, ExecutionConfig(), rngs=nnx.Rngs(0)))
        leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
        names = lambda path: (str(getattr(k, "key", getattr(k, "name", k))) for k in path)  # noqa: E731
        return {tuple(n for n in names(path) if n != "value"): tuple(x.shape)
                for path, x in leaves}

    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> float:
        """FLOPs per token (the architecture's `flops`; FLOP_FORMULA by default) at cfg's
        dimensions."""
        return self.flops(cfg, seq_len, self.count_params(cfg, exclude_embedding=True))
