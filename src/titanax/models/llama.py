"""Llama 3 in Flax NNX: RMSNorm, RoPE (llama3 scaling), grouped-query attention, SwiGLU MLP,
untied output layer. The layers are one stacked Block (parameters [layers, ...]) run with
jax.lax.scan, so compile time does not grow with depth.

Parameters carry logical axis names only; parallel/rules.py maps them to the mesh. Matmuls and
attention go through titanax.ops so kernels plug in by config.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from titanax import ops
from titanax.config import ModelConfig
from titanax.models.layers import RMSNorm, apply_rope, rms_norm, rope_inv_freq
from titanax.parallel.pipeline import PipelineSchedule, pipeline_stages, run_pipelined
from titanax.ops.cross_entropy import chunk_positions, linear_cross_entropy_sum
from titanax.parallel.rules import batch_shards, loss_rows, shard_activation

_FP8_SITES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the FP8 matmuls

# The name of each decoder layer's input inside its checkpointed function ("full_offload").
LAYER_INPUT = "decoder_layer_input"

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Full remat whose one saved value per layer, its input, goes to pinned host memory in the
    # forward pass and comes back for the layer's backward (no [layers, B, S, D] in HBM).
    "full_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
        offload_src="device", offload_dst="pinned_host"),
}


def _to_device(x):
    """x in device memory: a host-resident array (train.offload_params) is copied over."""
    if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def _param(rngs: nnx.Rngs, shape, names, std, dtype):
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype), out_sharding=names)


class Block(nnx.Module):
    """All n_layers decoder layers at once: every parameter has a leading 'layers' axis.
    Called on one layer's slice of the state (see Llama.__call__)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        L, d, hd = cfg.n_layers, cfg.d_model, cfg.resolved_head_dim
        pdt = jnp.dtype(cfg.param_dtype)
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.attn_norm = RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt, stack=L)
        self.wq = _param(rngs, (L, d, cfg.n_heads, hd), ("layers", "embed", "heads", "head_dim"), std, pdt)
        self.wk = _param(rngs, (L, d, cfg.n_kv_heads, hd), ("layers", "embed", "kv_heads", "head_dim"), std, pdt)
        self.wv = _param(rngs, (L, d, cfg.n_kv_heads, hd), ("layers", "embed", "kv_heads", "head_dim"), std, pdt)
        # wo and w_down are stored [out, in] (embed first, as HF stores them): FSDP's sharded
        # 'embed' is then each layer's major axis, which XLA:GPU gathers and reduce-scatters
        # in place (embed-last, it kept a transposed copy of the whole stack).
        self.wo = _param(rngs, (L, d, cfg.n_heads, hd), ("layers", "embed", "heads", "head_dim"), out_std, pdt)
        self.mlp_norm = RMSNorm(d, eps=cfg.norm_eps, param_dtype=pdt, stack=L)
        self.w_gate = _param(rngs, (L, d, cfg.ffn_dim), ("layers", "embed", "mlp"), std, pdt)
        self.w_up = _param(rngs, (L, d, cfg.ffn_dim), ("layers", "embed", "mlp"), std, pdt)
        self.w_down = _param(rngs, (L, d, cfg.ffn_dim), ("layers", "embed", "mlp"), out_std, pdt)
        if cfg.matmul_precision == "fp8_delayed":  # amax histories per FP8 call site
            for name in _FP8_SITES:
                setattr(self, f"fp8_{name}", ops.make_fp8_meta(L, cfg.fp8_amax_history))
        self.cfg = cfg

    def _meta(self, name):
        """This layer's amax histories for weight `name` (fp8_delayed), else None."""
        meta = getattr(self, f"fp8_{name}", None)
        return None if meta is None else ops.fp8_meta_dict(meta[...])

    def __call__(self, x_BSD, positions_BS, segment_ids_BS, kv=None, cache_index=None):
        cfg = self.cfg
        dt, prec = jnp.dtype(cfg.dtype), cfg.matmul_precision
        # A numpy constant at trace time (an array attribute would become module state).
        inv_freq = rope_inv_freq(cfg.resolved_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                 cfg.rope_factor, cfg.rope_low_freq_factor,
                                 cfg.rope_high_freq_factor, cfg.rope_original_max_seq_len)
        # Every projection: the compute dtype or an FP8 recipe, this call site's histories.
        lin = lambda x, w, spec, meta: ops.linear(
            x, w, spec, precision=prec, dtype=dt, fp8_meta=meta,
            grad_reduce=cfg.grad_reduce_dtype, mxfp8_scale_rounding=cfg.mxfp8_scale_rounding)
        h_BSD = self.attn_norm(x_BSD)
        q_BSHK = lin(h_BSD, self.wq[...], "bsd,dhk->bshk", self._meta("wq"))
        k_BSHK = lin(h_BSD, self.wk[...], "bsd,dhk->bshk", self._meta("wk"))
        v_BSHK = lin(h_BSD, self.wv[...], "bsd,dhk->bshk", self._meta("wv"))
        q_BSHK = shard_activation(apply_rope(q_BSHK, positions_BS, inv_freq),
                                  ("batch", "seq", "heads", "head_dim"))
        k_BSHK = shard_activation(apply_rope(k_BSHK, positions_BS, inv_freq),
                                  ("batch", "seq", "kv_heads", "head_dim"))
        if kv is None:  # training / scoring: the sequence attends to itself
            new_kv = None
            out_BSHK = ops.attention(q_BSHK, k_BSHK, v_BSHK, impl=cfg.attention_impl,
                                     causal=True, segment_ids=segment_ids_BS)
        else:  # decoding: write the new keys/values into the cache at cache_index
            k_cache, v_cache = kv
            k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k_BSHK.astype(k_cache.dtype), cache_index, axis=1)
            v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v_BSHK.astype(v_cache.dtype), cache_index, axis=1)
            new_kv = (k_cache, v_cache)
            out_BSHK = ops.attention(q_BSHK, k_cache, v_cache, impl=cfg.attention_impl,
                                     causal=True, q_offset=cache_index,
                                     kv_valid_len=cache_index + q_BSHK.shape[1])
        x_BSD = x_BSD + lin(out_BSHK, self.wo[...], "bshk,dhk->bsd", self._meta("wo"))
        x_BSD = shard_activation(x_BSD, ("batch", "norm_seq", "embed"))

        h_BSD = self.mlp_norm(x_BSD)
        gate_BSF = lin(h_BSD, self.w_gate[...], "bsd,df->bsf", self._meta("w_gate"))
        up_BSF = lin(h_BSD, self.w_up[...], "bsd,df->bsf", self._meta("w_up"))
        act_BSF = shard_activation(jax.nn.silu(gate_BSF) * up_BSF, ("batch", "seq", "mlp"))
        x_BSD = x_BSD + lin(act_BSF, self.w_down[...], "bsf,df->bsd", self._meta("w_down"))
        return shard_activation(x_BSD, ("batch", "norm_seq", "embed")), new_kv


class Llama(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg.init_std, pdt)
        self.layers = Block(cfg, rngs=rngs)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt)
        self.output = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg.init_std, pdt)

    def __call__(self, tokens_BS, positions_BS=None, segment_ids_BS=None, cache=None,
                 cache_index=None, pipeline: PipelineSchedule | None = None):
        """Logits [B, S, vocab] in the compute dtype, and the updated KV cache (or None).

        cache: {'k', 'v'} of [layers, B, max_len, kv_heads, head_dim] from init_cache();
        cache_index: how many positions of the cache are already filled.
        pipeline: run the layer stack staged over the mesh's 'pipeline' axis (when it is > 1;
        training and scoring only) instead of one scan.
        Training does not call this: `loss_sum` never holds the [B, S, vocab] logits.
        """
        cfg = self.cfg
        B, S = tokens_BS.shape
        if positions_BS is None:
            start = 0 if cache_index is None else cache_index
            positions_BS = jnp.broadcast_to(start + jnp.arange(S, dtype=jnp.int32), (B, S))
        x_BSD = self._embed(tokens_BS)
        one_layer, layer_state = self._layer_fn(cache_index)
        if cache is None:
            x_BSD = self._run_layers(one_layer, layer_state, x_BSD, positions_BS,
                                     segment_ids_BS, pipeline)
            new_cache = None
        else:
            x_BSD, new_kv = jax.lax.scan(
                lambda x, xs: one_layer(x, *xs, positions_BS, segment_ids_BS),
                x_BSD, (layer_state, (cache["k"], cache["v"])))
            new_cache = {"k": new_kv[0], "v": new_kv[1]}
        h_BSD = self.final_norm(x_BSD)
        # fp8=False: the output layer stays in the compute dtype under every FP8 recipe (its
        # logits feed the softmax directly; FP8 recipes keep it high precision).
        logits_BSV = ops.linear(h_BSD, self.output[...], "bsd,dv->bsv",
                                precision=cfg.matmul_precision, dtype=jnp.dtype(cfg.dtype),
                                fp8=False)
        return shard_activation(logits_BSV, ("batch", "seq", "vocab")), new_cache

    def loss_sum(self, tokens_BS, targets_BS, positions_BS, segment_ids_BS=None, *,
                 pipeline: PipelineSchedule | None = None, loss_chunk: int = 0):
        """Sum over all tokens of -log p(target), float32: the output layer and the
        cross-entropy fused and chunked (ops.cross_entropy), so no [B, S, vocab] float32
        logits exist. loss_chunk: tokens per device whose logits are alive at once (0: all).
        Pipelined runs compute it on each stage's share of the microbatches (gpipe,
        circular), or on the last stage as each microbatch leaves it (1f1b)."""
        x_BSD = self._embed(tokens_BS)
        one_layer, layer_state = self._layer_fn(None)
        head_params = (self.final_norm.scale[...], self.output[...])
        staged = pipeline is not None and pipeline_stages() > 1
        if staged and pipeline.schedule == "1f1b":
            from titanax.parallel.pipeline_1f1b import run_1f1b

            # Inside the pipeline's shard_map each microbatch's rows follow the 'batch' rule.
            head = lambda hp, y_bSD, t_bS: head_nll_sum(self.cfg, hp, y_bSD, t_bS,
                                                        loss_chunk, rows="batch")
            return run_1f1b(lambda x, state, ex: one_layer(x, state, None, *ex)[0], head,
                            layer_state, head_params, x_BSD, (positions_BS, segment_ids_BS),
                            targets_BS, pipeline.microbatches)
        x_BSD = self._run_layers(one_layer, layer_state, x_BSD, positions_BS, segment_ids_BS,
                                 pipeline)
        rows = loss_rows(x_BSD.shape[0])
        return head_nll_sum(self.cfg, head_params, shard_activation(x_BSD, (rows, "seq", "embed")),
                            shard_activation(targets_BS, (rows, "seq")), loss_chunk, rows=rows)

    def _embed(self, tokens_BS):
        x_BSD = jnp.take(self.embed[...], tokens_BS, axis=0).astype(jnp.dtype(self.cfg.dtype))
        return shard_activation(x_BSD, ("batch", "norm_seq", "embed"))

    def _layer_fn(self, cache_index):
        """(one_layer(x, layer_state, kv, positions, segment_ids) -> (x, kv), the stacked
        layer state): one decoder layer as a pure function, remat-wrapped per model.remat."""
        graphdef, layer_state = nnx.split(self.layers)
        offload_input = self.cfg.remat == "full_offload"

        def one_layer(x_BSD, state, kv, positions_BS, segment_ids_BS):
            if offload_input:  # the value the policy offloads; x itself is then not kept
                x_BSD = checkpoint_name(x_BSD, LAYER_INPUT)
            # train.offload_params: the layer's slice of the stacked weights lives in host
            # memory; it comes over here, inside the checkpoint, so the backward pass fetches
            # it again instead of keeping a device copy of every layer.
            state = jax.tree.map(_to_device, state)
            block = nnx.merge(graphdef, state)
            return block(x_BSD, positions_BS, segment_ids_BS, kv, cache_index)

        if self.cfg.remat != "none":
            one_layer = jax.checkpoint(one_layer, policy=_REMAT_POLICIES[self.cfg.remat],
                                       prevent_cse=False)
        return one_layer, layer_state

    def _run_layers(self, one_layer, layer_state, x_BSD, positions_BS, segment_ids_BS,
                    pipeline):
        if pipeline is not None and pipeline_stages() > 1:
            return run_pipelined(lambda x, state, ex: one_layer(x, state, None, *ex)[0],
                                 layer_state, x_BSD, (positions_BS, segment_ids_BS), pipeline)
        x_BSD, _ = jax.lax.scan(
            lambda x, state: (one_layer(x, state, None, positions_BS, segment_ids_BS)[0], None),
            x_BSD, layer_state)
        return x_BSD


def head_nll_sum(cfg: ModelConfig, head_params, x_BSD, targets_BS, loss_chunk: int, *,
                 rows: str = "batch"):
    """Final norm, output layer and cross-entropy of the last layer's output: the summed
    float32 loss. head_params = (final norm scale, output weight [d, vocab]); rows: the
    logical name the batch rows are sharded by (see loss_rows)."""
    norm_scale, w_DV = head_params
    dt = jnp.dtype(cfg.dtype)
    h_BSD = rms_norm(x_BSD, norm_scale, cfg.norm_eps)
    B, S, _ = h_BSD.shape
    chunk = chunk_positions(S, B // batch_shards(rows), loss_chunk)
    # The output layer stays in the compute dtype under every FP8 recipe (its logits feed the
    # softmax directly); 'highest' keeps its meaning here too.
    precision = "highest" if cfg.matmul_precision == "highest" else "default"
    # model.grad_reduce_dtype=float32: the weight enters in its own dtype, and its gradient
    # (summed in float32 over the chunks) leaves in it, so FSDP reduces it in float32.
    w_DV = w_DV if cfg.grad_reduce_dtype == "float32" else w_DV.astype(dt)
    return linear_cross_entropy_sum(h_BSD.astype(dt), w_DV, targets_BS, chunk=chunk,
                                    precision=precision, rows=rows)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> dict:
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.resolved_head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def count_params(cfg: ModelConfig, *, exclude_embedding: bool = False) -> int:
    """Exact parameter count from jax.eval_shape: nothing is allocated."""
    from titanax.parallel.mesh import single_device_mesh
    from titanax.parallel.rules import model_context

    with model_context(single_device_mesh()):
        abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.All(nnx.Param, nnx.Not(ops.Fp8Meta)))  # no amax histories
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
    if exclude_embedding:
        total -= cfg.vocab_size * cfg.d_model
    return total


def _spec():
    from titanax.models.presets import PRESETS
    from titanax.models.spec import ModelSpec

    return ModelSpec(arch="llama3", build=Llama, init_cache=init_cache, presets=PRESETS)


SPEC = _spec()
