"""Analytic memory per device of one train step: what the compiled step's buffers hold at its
peak (docs/planner.md checks it against XLA's figures for every row of its table).

The peak is either at the start of the layers' backward pass (the state, every layer's saved
activations, the whole gradient buffer the backward writes into, and one layer being
recomputed and differentiated) or in the loss (the state, the saved activations and the loss's
own buffers, before the layers' gradients exist), whichever is larger. Host memory (pinned)
holds what the offload options move out of HBM; it is reported apart.

Context parallelism (cp = mesh.context) splits each sequence over cp devices: every activation
is S/cp tokens per device, and parameters, gradients and Adam's moments are sharded over
fsdp x cp (parallel/rules.py: 'embed' -> ("fsdp", "context")). The attention's K/V exchange
adds its buffers for one layer ('context_kv').

The state's rows come from what the run trains (plan/state_shape.py, by the role the optimizer
moves: plan/training.py FullTraining's 'weights', 'optimizer', 'gradients'; under LoRA
plan/lora.py's 'base_weights', 'adapters', 'adapter_optimizer', 'adapter_gradients').
Activations are the same either way.

Weights split over the mesh as the architecture says (plan/param_layout.py: a mixture of
experts' leaf by leaf, the experts also over 'expert', the router not over tensor); with
mesh.expert > 1 the batch's rows split over expert x data x fsdp, and one layer's all-to-all
buffers are a row of their own ('expert_buffers', plan/moe.py); the layer's backward transient
is the architecture's when its spec has one (models/common/moe_plan.py).

Names: N parameters, L layers, d width, f MLP width, V vocabulary, tp/fsdp/cp/pp/dp mesh
degrees, a = train.grad_accum, m = pipeline microbatches, v = virtual stages.
"""

from __future__ import annotations

from titanax.config import Config, ModelConfig, grad_accum_in_place_unsupported
from titanax.config.parallel import batch_ways
from titanax.plan.moe import dispatch_buffer_bytes
from titanax.plan.param_layout import ParamSplit, param_shards
from titanax.plan.state_shape import plan_state
from titanax.plan.step_shape import StepShape


def saved_elems_per_token(m: ModelConfig, remat: str) -> float:
    """Values per token and layer the backward keeps from the forward (in activations of the
    compute dtype): full remat keeps the layer input; 'dots' keeps every matmul output (q, k,
    v, the attention output projection, gate, up, down) and the input; 'none' keeps everything
    the layer computes (norm outputs, RoPE'd q/k, SwiGLU products as well)."""
    d, f, kv = m.d_model, m.ffn_dim, m.n_kv_heads * m.resolved_head_dim
    q = m.n_heads * m.resolved_head_dim
    if remat in ("full", "full_offload"):
        return d
    if remat in ("dots", "dots_no_batch"):
        return d + q + 2 * kv + d + 2 * f + d
    return 3 * d + 2 * (q + 2 * kv) + q + d + 4 * f + d


def param_split(cfg: Config, deg: dict[str, int]) -> ParamSplit:
    """The weights per device as the architecture's layout splits them (plan/param_layout.py)."""
    return plan_state(cfg).layout.split(deg)


def pipeline_in_flight(cfg: Config, pp: int) -> float:
    """Microbatch-layer inputs a stage keeps for the backward, in units of one microbatch
    through one layer: gpipe/circular keep every layer input of every tick (autodiff of the
    whole tick loop: (m v + pp - 1) ticks of L/(pp v) layers); 1f1b keeps its layers' inputs
    for at most 2 pp - 1 microbatches in flight (parallel/pipeline_1f1b.py)."""
    L = cfg.model.n_layers
    m, v = cfg.pipeline.microbatches, cfg.pipeline.resolved_virtual_stages
    if cfg.pipeline.schedule == "1f1b":
        return min(m, 2 * pp - 1) * L / pp
    return (m * v + pp - 1) * L / (pp * v)


def memory_per_device(cfg: Config, deg: dict[str, int]
                      ) -> tuple[dict[str, float], dict[str, float]]:
    """({component: bytes in HBM, 'total'}, {component: bytes in pinned host memory, 'total'})
    per device for cfg on a mesh of degrees `deg`."""
    t, cp = cfg.train, deg.get("context", 1)
    training = plan_state(cfg).training
    # Tokens of one grad-accumulation microbatch on this device: its (expert x) data x fsdp
    # share of the rows, and its 1/context share of each row's sequence.
    tokens = t.batch_size * t.seq_len / (t.grad_accum * batch_ways(deg) * cp)
    # Weights, the optimizer's state and the gradient buffer, as the trained role has them.
    device, host = training.state_bytes(cfg, deg, param_split(cfg, deg))
    saved = _saved_activation_bytes(cfg, deg, tokens)
    if cfg.execution.remat == "full_offload":  # the layer inputs wait in pinned host memory
        host["saved_activations"], saved = saved, 0.0
    device["saved_activations"] = saved
    device["transient"] = _transient_bytes(cfg, deg, tokens, device[training.gradient_row])
    if t.grad_accum > 1 and grad_accum_in_place_unsupported(cfg) is None:
        device["accumulation"] = _in_place_loop_bytes(cfg, deg)
    if cp > 1:
        device["context_kv"] = context_kv_bytes(cfg, deg, tokens)
    if expert := dispatch_buffer_bytes(cfg, StepShape.of(cfg, deg)):  # 0 without a dispatch
        device["expert_buffers"] = expert
    device["total"] = sum(device.values())
    host["total"] = sum(host.values())
    return device, host


def _micro(cfg: Config, deg: dict[str, int]) -> int:
    return cfg.pipeline.microbatches if deg["pipeline"] > 1 else 1


def _saved_activation_bytes(cfg: Config, deg: dict[str, int], tokens: float) -> float:
    """The layer inputs (or more, by remat policy) of this
    stage's layers for every token it holds; sequence- or head-sharded over tensor."""
    m, tp, pp = cfg.model, deg["tensor"], deg["pipeline"]
    d, abytes = m.d_model, 4 if cfg.execution.dtype == "float32" else 2
    if pp > 1:
        tokens_micro = tokens / _micro(cfg, deg)  # one pipeline microbatch
        # Inside the pipeline a tick keeps each layer's input only (its own checkpoint).
        saved = pipeline_in_flight(cfg, pp) * tokens_micro * d * abytes / tp
        # Whole-step activation buffers outside the layers, each tokens x d (sequence
        # parallel: split over tensor like the layer inputs). 1f1b: the inputs, their
        # gradient and the microbatch-major copy; gpipe/circular (measured, --buffers): also
        # the parked and finished microbatches with their cotangents and the loss's hidden
        # states and their gradient.
        saved += (3 if cfg.pipeline.schedule == "1f1b" else 7) * tokens * d * abytes / tp
    else:  # the architecture's own count when its spec has one (models/spec.py)
        per_token = plan_state(cfg).spec.activation_elems or saved_elems_per_token
        saved = m.n_layers * tokens * per_token(m, cfg.execution.remat) * abytes / tp
    return saved


def _in_place_loop_bytes(cfg: Config, deg: dict[str, int]) -> float:
    """What the microbatch loop of the in-place sum holds beside the sum (measured, 70B on
    8x H100, `launch.plan --buffers`): the output weight gathered in the compute dtype, which
    XLA's pipelined all-gather fetches once for the next microbatch and keeps through the
    backward, and the zero-initialised float32 sums of the embedding and output layer kept
    beside their loop carries."""
    m, tp = cfg.model, deg["tensor"]
    d, V, abytes = m.d_model, m.vocab_size, 4 if cfg.execution.dtype == "float32" else 2
    tables = 1 if m.tie_embeddings else 2
    return d * V / tp * abytes + tables * d * V / (tp * param_shards(deg)) * 4


def _transient_bytes(cfg: Config, deg: dict[str, int], tokens: float,
                     gradient_bytes: float) -> float:
    """The largest buffers live for a moment: one layer's backward or the loss."""
    m, t, tp, pp = cfg.model, cfg.train, deg["tensor"], deg["pipeline"]
    d, V, abytes = m.d_model, m.vocab_size, 4 if cfg.execution.dtype == "float32" else 2
    micro = _micro(cfg, deg)
    tokens_micro = tokens / micro
    # One layer's backward, at its largest point (the MLP, measured in the compiled buffers,
    # `launch.plan --buffers`, with the GPU XLA flags of real runs): the gate, up and product
    # activations, their gradients and the recompute's matmul outputs for one (pipeline)
    # microbatch (six [tokens, ffn] buffers: the layer loop is double-buffered, so the next
    # layer's recompute overlaps this one's backward), four [tokens, d] ones (the normed
    # input, q after RoPE, the attention output, the incoming gradient), and two layers' MLP
    # weights gathered in the compute dtype (one prefetched) with an unreduced gradient. The
    # gradient itself goes straight into its slot of the gradient buffer. Refit against
    # every row of docs/planner.md's compiled-memory table (scripts/planner_memory_table.py).
    # With the loop single-buffered (execution.loop_double_buffering=false) the compiles hold
    # half a [tokens, ffn] buffer less (70B, FSDP, grad_accum 1: 172.8 -> 172.3 GB on 8x B200
    # at batch 16, 78.1 -> 77.1 on 64x H100 at batch 256).
    ffn_buffers = 6 if cfg.execution.loop_double_buffering else 5.5
    layer_transient = (tokens_micro * (ffn_buffers * m.ffn_dim + 4 * d) * abytes / tp
                       + 6 * d * m.ffn_dim / tp * abytes)
    # the architecture's own (an MoE's: the same buffers over the experts' rows) when it has
    # one (models/spec.py PlannerTerms.layer_transient_bytes)
    own = plan_state(cfg).terms.layer_transient_bytes(
        cfg, StepShape.of(cfg, deg), param_split(cfg, deg).one_layer)
    layer_transient = layer_transient if own is None else own
    # The loss: one chunk of float32 logits, their exponentials and their gradient in the
    # compute dtype, the output weight gathered over fsdp, its float32 gradient sum (which XLA
    # keeps reduce-scattered over fsdp x context), and the last hidden states with their
    # gradient.
    # gpipe/circular run it on each stage's share of the microbatches; 1f1b on one microbatch
    # at a time on the last stage.
    if pp > 1 and cfg.pipeline.schedule == "1f1b":
        loss_tokens = tokens_micro
    elif pp > 1 and micro % pp == 0:
        loss_tokens = tokens / pp
    else:
        loss_tokens = tokens
    chunk = min(t.loss_chunk or loss_tokens, loss_tokens)
    # (none when the output layer is frozen: LoRA's weight_gradients 0, plan/training.py)
    output_grad = plan_state(cfg).training.weight_gradients * (d * V / (tp * param_shards(deg))
                                                               * 4)
    loss_transient = (chunk * V / tp * (4 + 4 + abytes) + d * V / tp * abytes
                      + output_grad + 2 * loss_tokens * d * abytes)
    # The loss runs before the layers' gradient buffer exists.
    return max(layer_transient, loss_transient - gradient_bytes)


def context_kv_bytes(cfg: Config, deg: dict[str, int], tokens: float) -> float:
    """The K/V exchange of context parallelism, for one layer's attention backward (its largest
    point), per device; `tokens` = this device's tokens of one accumulation microbatch.
    ring: K and V blocks ([rows, S/cp, kv_heads/tp, head_dim], compute dtype) double-buffered
    (the block in use and the one arriving), and the float32 dK, dV accumulators passed around
    with them, double-buffered too. all_gather: K and V gathered over all cp devices and their
    float32 gradients for the whole sequence before the reduce-scatter. Counted on top of the
    MLP transient, which is an upper bound: the two are live one after the other."""
    m, cp = cfg.model, deg.get("context", 1)
    abytes = 4 if cfg.execution.dtype == "float32" else 2
    # one K (or V) block: this device's tokens of one pipeline microbatch, its kv heads
    block = (tokens / _micro(cfg, deg) * m.n_kv_heads * m.resolved_head_dim / deg["tensor"])
    if cfg.execution.context_strategy == "all_gather":
        return 2 * cp * block * (abytes + 4)
    return 2 * 2 * block * (abytes + 4)
