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

LoRA (lora.rank > 0, docs/lora.md): the state is the frozen base in model.param_dtype, with
no gradient and no optimizer state, and the adapters (plan/lora.py) in float32 with their
float32 gradients and the update rule's state (optimizer state is tx.init(adapters)); rows
'base_weights', 'adapters', 'adapter_optimizer', 'adapter_gradients' replace 'weights',
'optimizer', 'gradients'. Activations are the same as full fine-tuning's.

Mixture of experts (docs/moe.md, Planner): parameters, gradients and optimizer state are counted
leaf by leaf as parallel/rules.py splits them (plan/param_layout.py: the experts also over
'expert', the router not over tensor); with mesh.expert > 1 the batch's rows split over
expert x data x fsdp, and one layer's all-to-all buffers are a row of their own
('expert_buffers', plan/moe.py).

Names: N parameters, L layers, d width, f MLP width, V vocabulary, tp/fsdp/cp/pp/dp mesh
degrees, a = train.grad_accum, m = pipeline microbatches, v = virtual stages.
"""

from __future__ import annotations

import dataclasses

from titanax.config import Config, ModelConfig, grad_accum_in_place_unsupported
from titanax.config.moe import MoEModelConfig
from titanax.models.registry import model_spec
from titanax.plan.lora import adapter_params
from titanax.plan.moe import dispatch_buffer_bytes, is_moe, layer_transient_bytes
from titanax.plan.param_layout import exact_split
from titanax.plan.step_shape import StepShape, batch_ways
from titanax.train.optim import update_rule


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


def param_shards(deg: dict[str, int]) -> int:
    """The FSDP group: parameters are sharded (and gathered) over fsdp x context, because the
    context ranks of a row hold other tokens of it and sum their gradients anyway."""
    return deg["fsdp"] * deg.get("context", 1)


def param_split(m: ModelConfig, n_params: int, deg: dict[str, int]) -> ParamSplit:
    """Dense: n_params split uniformly (exact but for the norm scales); a mixture of experts:
    leaf by leaf (its parameters split unalike; n_params is not read)."""
    if isinstance(m, MoEModelConfig):
        return ParamSplit(*exact_split(m, deg))
    tp, shards, pp = deg["tensor"], param_shards(deg), deg["pipeline"]
    # the parameters outside the layer stack: embedding, output layer (none when tied), norm
    other = (1 if m.tie_embeddings else 2) * m.vocab_size * m.d_model + m.d_model
    layers = n_params - other
    return ParamSplit(layers / (shards * tp * pp), other / (shards * tp),
                      layers / m.n_layers / tp)


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


def memory_per_device(cfg: Config, deg: dict[str, int], n_params: int
                      ) -> tuple[dict[str, float], dict[str, float]]:
    """({component: bytes in HBM, 'total'}, {component: bytes in pinned host memory, 'total'})
    per device for cfg on a mesh of degrees `deg`."""
    t, cp = cfg.train, deg.get("context", 1)
    # Tokens of one grad-accumulation microbatch on this device: its (expert x) data x fsdp
    # share of the rows, and its 1/context share of each row's sequence.
    tokens = t.batch_size * t.seq_len / (t.grad_accum * batch_ways(deg) * cp)
    device, host = _state_bytes(cfg, deg, n_params)
    saved = _saved_activation_bytes(cfg, deg, tokens)
    if cfg.execution.remat == "full_offload":  # the layer inputs wait in pinned host memory
        host["saved_activations"], saved = saved, 0.0
    device["saved_activations"] = saved
    gradients = device["adapter_gradients" if cfg.lora.enabled else "gradients"]
    device["transient"] = _transient_bytes(cfg, deg, tokens, gradients)
    if t.grad_accum > 1 and grad_accum_in_place_unsupported(cfg) is None:
        device["accumulation"] = _in_place_loop_bytes(cfg, deg)
    if cp > 1:
        device["context_kv"] = context_kv_bytes(cfg, deg, tokens)
    if is_moe(cfg) and (expert := dispatch_buffer_bytes(cfg, StepShape.of(cfg, deg))):
        device["expert_buffers"] = expert
    device["total"] = sum(device.values())
    host["total"] = sum(host.values())
    return device, host


def _state_bytes(cfg: Config, deg: dict[str, int], n_params: int
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """Weights, the optimizer's moments and the gradient buffer: ({HBM}, {pinned host}) per
    device."""
    if cfg.lora.enabled:
        return _lora_state_bytes(cfg, deg, n_params), {}
    m, t = cfg.model, cfg.train
    pbytes = 4 if m.param_dtype == "float32" else 2
    p = param_split(m, n_params, deg)
    device, host = {}, {}
    weights = p.total * pbytes
    # The update rule's state (train/optim.py's table; AdamW: mu and nu in the param dtype).
    moments = p.total * update_rule(cfg).state_bytes(pbytes)
    grads = p.total * 4  # float32, reduce-scattered into this shard layer by layer
    if t.offload_params:  # the layers' master weights live on the host
        host["weights"] = p.layers * pbytes
        weights -= p.layers * pbytes
        if t.grad_accum == 1:  # and their gradients too, read a layer at a time by the update
            host["gradients"] = p.layers * 4
            grads -= p.layers * 4
        # (with grad_accum the sum runs in place, on the device: models/accumulate.py)
    if t.offload_optimizer:
        host["optimizer"] = moments
        moments = 0.0
    device["weights"] = weights
    device["optimizer"] = moments
    # Accumulating in place (models/accumulate.py) the backward adds each layer's gradients into
    # the one running sum (a layer's fresh gradients are in the transient term). The plain sum
    # keeps the sum and the microbatch's fresh stacked buffer at once.
    plain = t.grad_accum != 1 and grad_accum_in_place_unsupported(cfg) is not None
    device["gradients"] = grads * (2 if plain else 1)
    return device, host


def _lora_state_bytes(cfg: Config, deg: dict[str, int], n_params: int) -> dict[str, float]:
    """LoRA's state per device (HBM; the config refuses host offload with LoRA): the frozen
    base in its param dtype alone, the adapters float32 with the update rule's state for
    float32 parameters and a float32 gradient buffer, each factor sharded as plan/lora.py
    says."""
    m = cfg.model
    base = param_split(m, n_params, deg).total * (4 if m.param_dtype == "float32" else 2)
    adapters = adapter_params(m, cfg.lora).per_device(deg)
    # Only the adapters are differentiated, and their gradients are always summed the plain way
    # (config.grad_accum_in_place_unsupported): the sum and one microbatch's, with grad_accum.
    plain = cfg.train.grad_accum != 1
    return {"base_weights": base, "adapters": adapters * 4,
            "adapter_optimizer": adapters * update_rule(cfg).state_bytes(4),
            "adapter_gradients": adapters * 4 * (2 if plain else 1)}


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
        per_token = model_spec(m).activation_elems or saved_elems_per_token
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
    if is_moe(cfg):  # the same buffers over the experts' rows (plan/moe.py)
        layer_transient = layer_transient_bytes(cfg, StepShape.of(cfg, deg),
                                                param_split(m, 0, deg).one_layer)
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
    # (LoRA: the output layer is frozen, so no gradient sum of it)
    output_grad = 0.0 if cfg.lora.enabled else d * V / (tp * param_shards(deg)) * 4
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
