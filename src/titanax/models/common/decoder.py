"""The decoder-stack machinery every architecture under models/ shares: input embedding, the
stacked layers run by one jax.lax.scan (or staged over the 'pipeline' mesh axis), remat
policies, host-offloaded weights, the final norm and the output layer (untied, or the
embedding transposed), and the fused, chunked loss head.

An architecture subclasses Decoder with its block options (common/block.py: one module holds
all n_layers layers, every parameter with a leading 'layers' axis) and its logical-axis table
(common/sharding.py decoder_axes).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from titanax import ops
from titanax.config import ExecutionConfig, ModelConfig
from titanax.models import accumulate
from titanax.models.common.block import BlockOptions, DecoderBlock
from titanax.models.common.layers import RMSNorm, make_param, rms_norm
from titanax.models.common.lora import block_arguments, with_dropout_keys
from titanax.ops.cross_entropy import chunk_positions, linear_cross_entropy_sum, seq_split
from titanax.parallel.context import balanced, context_shards, natural
from titanax.parallel.layer_order import to_storage_order
from titanax.parallel.pipeline import PipelineSchedule, pipeline_stages, run_pipelined
from titanax.parallel.rules import batch_shards, loss_rows, shard_activation

# The name of each decoder layer's input inside its checkpointed function ("full_offload").
LAYER_INPUT = "decoder_layer_input"

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Full remat whose one saved value per layer, its input, goes to pinned host memory in the
    # forward pass and comes back for the layer's backward (no [layers, B, S, D] in HBM).
    "full_offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=(LAYER_INPUT,),
        offload_src="device", offload_dst="pinned_host"),
}


class Decoder(nnx.Module):
    """embed -> layers (block_cls, stacked) -> final_norm -> output (or embed transposed when
    model.tie_embeddings). An architecture subclasses it with its block_options and
    param_axes (and block_cls when its layer is not the common DecoderBlock, e.g. an MoE)."""

    # block_cls(cfg, execution, block_options, param_axes, rngs=[, lora=]) -> a module called
    # on one layer's slice (lora: the LoraConfig, passed only when lora.rank > 0)
    block_cls: type = DecoderBlock
    block_options: BlockOptions = BlockOptions()
    # Logical axis names of every parameter (common/sharding.py decoder_axes): the block's and
    # 'embed', 'output', 'final_norm'.
    param_axes: Mapping[str, tuple[str, ...]] = {}

    def __init__(self, cfg: ModelConfig, execution: ExecutionConfig, *, rngs: nnx.Rngs,
                 lora=None):
        """lora: the config's lora section; with lora.rank > 0 the block carries adapters
        (common/lora.py). None or rank 0: the model without them, unchanged."""
        pdt, axes = jnp.dtype(cfg.param_dtype), self.param_axes
        self.cfg, self.execution = cfg, execution
        self.embed = make_param(rngs, (cfg.vocab_size, cfg.d_model), axes["embed"],
                                execution.init_std, pdt)
        self.layers = self.block_cls(cfg, execution, self.block_options, axes, rngs=rngs,
                                     **block_arguments(lora))
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, param_dtype=pdt,
                                  axes=axes["final_norm"])
        if not cfg.tie_embeddings:  # tied: no parameter, the output layer is embed.T
            self.output = make_param(rngs, (cfg.d_model, cfg.vocab_size), axes["output"],
                                     execution.init_std, pdt)

    def output_weight(self):
        """The output layer's weight [d, vocab]: its own, or the input embedding transposed
        (the transpose is differentiable, so both uses add into embed's gradient)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.output[...]

    def __call__(self, tokens_BS, positions_BS=None, segment_ids_BS=None, cache=None,
                 cache_index=None, pipeline: PipelineSchedule | None = None):
        """Logits [B, S, vocab] in the compute dtype, and the updated KV cache (or None).

        cache: {'k', 'v'} of [layers, B, max_len, kv_heads, head_dim] from init_cache();
        cache_index: how many positions of the cache are already filled.
        pipeline: run the layer stack staged over the mesh's 'pipeline' axis (when it is > 1;
        training and scoring only) instead of one scan.
        Training does not call this: `loss_sum` never holds the [B, S, vocab] logits.
        """
        ex = self.execution
        B, S = tokens_BS.shape
        if positions_BS is None:
            start = 0 if cache_index is None else cache_index
            positions_BS = jnp.broadcast_to(start + jnp.arange(S, dtype=jnp.int32), (B, S))
        C = context_shards(S) if cache is None else 1  # decoding splits no sequence
        tokens_BS, positions_BS, segment_ids_BS = (
            None if x is None else balanced(x, C) for x in (tokens_BS, positions_BS,
                                                            segment_ids_BS))
        x_BSD = self._embed(tokens_BS)
        one_layer, layer_state = self._layer_fn(cache_index)
        if cache is None:
            x_BSD = self._run_layers(one_layer, layer_state, x_BSD,
                                     (positions_BS, segment_ids_BS), pipeline)
            new_cache = None
        else:
            x_BSD, new_kv = jax.lax.scan(  # (an MoE layer's routing sums are not kept here)
                lambda x, xs: one_layer(x, *xs, positions_BS, segment_ids_BS)[:2],
                x_BSD, (layer_state, (cache["k"], cache["v"])))
            new_cache = {"k": new_kv[0], "v": new_kv[1]}
        h_BSD = self.final_norm(x_BSD)
        # fp8=False: the output layer stays in the compute dtype under every FP8 recipe (its
        # logits feed the softmax directly; FP8 recipes keep it high precision).
        logits_BSV = ops.linear(h_BSD, self.output_weight(), "bsd,dv->bsv",
                                precision=ex.matmul_precision, dtype=jnp.dtype(ex.dtype),
                                fp8=False)
        logits_BSV = natural(shard_activation(logits_BSV, ("batch", "seq", "vocab")), C)
        return shard_activation(logits_BSV, ("batch", "seq", "vocab")), new_cache

    def loss_sum(self, tokens_BS, targets_BS, positions_BS, segment_ids_BS=None, *,
                 pipeline: PipelineSchedule | None = None, loss_chunk: int = 0,
                 lora_dropout_keys=None):
        """Sum over all tokens of -log p(target), float32: the output layer and the
        cross-entropy fused and chunked (ops.cross_entropy), so no [B, S, vocab] float32
        logits exist. loss_chunk: tokens per device whose logits are alive at once (0: all).
        Pipelined runs compute it on each stage's share of the microbatches (gpipe,
        circular), or on the last stage as each microbatch leaves it (1f1b). With the sequence
        split over 'context', every per-token input is taken in parallel/context.py's
        balanced order (a sum over tokens needs no reordering back).
        lora_dropout_keys: uint32 [B, S, 2], each token's adapter-dropout key (common/lora.py
        dropout_token_keys), given by the train step with lora.dropout > 0 only: they travel
        with the tokens (microbatches, sequence order) and each layer gets its logical index
        with its weights, so the masks do not depend on the layout."""
        C = context_shards(tokens_BS.shape[1])
        tokens_BS, targets_BS, positions_BS, segment_ids_BS = (
            None if x is None else balanced(x, C)
            for x in (tokens_BS, targets_BS, positions_BS, segment_ids_BS))
        x_BSD = self._embed(tokens_BS)
        extras, dropout_layers = with_dropout_keys(
            (positions_BS, segment_ids_BS), lora_dropout_keys, lambda k: balanced(k, C),
            lambda: self._stored_layer_ids(pipeline))
        one_layer, layer_state = self._layer_fn(None, dropout_layers=dropout_layers)
        head_params = (self.final_norm.scale[...], self.output_weight())
        staged = pipeline is not None and pipeline_stages() > 1
        if staged and pipeline.schedule == "1f1b":
            from titanax.parallel.pipeline_1f1b import run_1f1b

            # Inside the pipeline's shard_map each microbatch's rows follow the 'batch' rule.
            head = lambda hp, y_bSD, t_bS: head_nll_sum(
                self.cfg, self.execution, hp, y_bSD, t_bS, loss_chunk, rows="batch")
            return run_1f1b(lambda x, state, ex: one_layer(x, state, None, *ex)[0], head,
                            layer_state, head_params, x_BSD, (positions_BS, segment_ids_BS),
                            targets_BS, pipeline.microbatches)
        x_BSD = self._run_layers(one_layer, layer_state, x_BSD, extras, pipeline,
                                 dropout_layers)
        rows = loss_rows(x_BSD.shape[0])
        return head_nll_sum(self.cfg, self.execution, head_params,
                            shard_activation(x_BSD, (rows, "seq", "embed")),
                            shard_activation(targets_BS, (rows, "seq")), loss_chunk, rows=rows)

    def _embed(self, tokens_BS):
        table_VD = self.embed[...]
        if context_shards(tokens_BS.shape[1]) > 1:
            # The table's width is split over fsdp x context and the lookup's rows over
            # (batch, seq): XLA cannot turn one into the other without replicating the
            # looked-up [B, S, d], so the table is gathered first (in the compute dtype), as
            # FSDP gathers every weight for its use.
            table_VD = shard_activation(table_VD.astype(jnp.dtype(self.execution.dtype)),
                                        ("vocab", "embed"))
        x_BSD = jnp.take(table_VD, tokens_BS, axis=0).astype(jnp.dtype(self.execution.dtype))
        return shard_activation(x_BSD, ("batch", "norm_seq", "embed"))

    def _stored_layer_ids(self, pipeline: PipelineSchedule | None):
        """int32 [L]: the logical index of each layer of the stack as stored (circular
        pipelines store it stage-major, parallel/layer_order.py), for adapter dropout."""
        ids_L = jnp.arange(self.cfg.n_layers, dtype=jnp.int32)
        if pipeline is None or pipeline_stages() == 1:
            return ids_L
        return to_storage_order(ids_L, pipeline_stages(), pipeline.virtual_stages)

    def _layer_fn(self, cache_index, remat: str | None = None, dropout_layers=None):
        """(one_layer(x, layer_state, kv, positions, segment_ids[, dropout_keys]) -> (x, kv),
        the stacked layer state): one decoder layer as a pure function, remat-wrapped per
        execution.remat (or `remat`). dropout_layers: _stored_layer_ids, for adapter dropout
        (training with lora.dropout > 0): the layer state is then (the block's, the ids), so
        a layer gets its index as it gets its weights (scan, remat and pipeline alike), and
        one_layer takes the tokens' dropout keys as its last input."""
        remat = remat or self.execution.remat
        graphdef, layer_state = nnx.split(self.layers)
        if dropout_layers is not None:
            layer_state = (layer_state, dropout_layers)
        offload_input = remat == "full_offload"

        def one_layer(x_BSD, state, kv, positions_BS, segment_ids_BS, dropout_keys_BS2=None):
            if offload_input:  # the value the policy offloads; x itself is then not kept
                x_BSD = checkpoint_name(x_BSD, LAYER_INPUT)
            drop = {}
            if dropout_keys_BS2 is not None:
                state, layer = state
                drop = {"lora_dropout": (dropout_keys_BS2, layer)}
            # train.offload_params: the layer's slice of the stacked weights lives in host
            # memory; it comes over here, inside the checkpoint, so the backward pass fetches
            # it again instead of keeping a device copy of every layer.
            state = jax.tree.map(accumulate.to_device, state)
            block = nnx.merge(graphdef, state)
            return block(x_BSD, positions_BS, segment_ids_BS, kv, cache_index, **drop)

        if remat != "none":
            one_layer = jax.checkpoint(one_layer, policy=REMAT_POLICIES[remat],
                                       prevent_cse=False)
        return one_layer, layer_state

    def _run_layers(self, one_layer, layer_state, x_BSD, extras, pipeline,
                    dropout_layers=None):
        """x after all layers. extras: one_layer's per-token inputs after kv ([B, S, ...]
        each, or None), split into microbatches with x by a pipeline."""
        if pipeline is not None and pipeline_stages() > 1:
            if hasattr(self.layers, "aux_zeros"):  # an MoE block: the stages carry its sums
                def x_and_sums(x, state, ex):
                    x, _, sums = one_layer(x, state, None, *ex)
                    return x, sums
                x_BSD, total = run_pipelined(x_and_sums, layer_state, x_BSD, extras, pipeline,
                                             aux_zeros=self.layers.aux_zeros())
                self.layer_aux = nnx.Intermediate(total)
                return x_BSD
            return run_pipelined(lambda x, state, ex: one_layer(x, state, None, *ex)[0],
                                 layer_state, x_BSD, extras, pipeline)
        slot = accumulate.pending()
        if slot is not None:  # train.grad_accum in place: the backward adds into the sum
            # It saves (or offloads) each layer's input itself: the layer is plain full remat.
            full, _ = self._layer_fn(None, remat="full", dropout_layers=dropout_layers)
            return accumulate.scan_layers_into(
                slot, lambda x, state, *ex: full(x, state, None, *ex)[0], layer_state,
                x_BSD, extras, offload_inputs=self.execution.remat == "full_offload")
        if hasattr(self.layers, "aux_zeros"):  # an MoE block: its routing sums add up too
            return self._scan_with_aux(one_layer, layer_state, x_BSD, extras)
        x_BSD, _ = jax.lax.scan(lambda x, state: (one_layer(x, state, None, *extras)[0], None),
                                x_BSD, layer_state)
        return x_BSD

    def _scan_with_aux(self, one_layer, layer_state, x_BSD, extras):
        """The layer scan of a block that also returns per-layer sums (MoEBlock: routing);
        their total over the layers is kept as self.layer_aux, an nnx.Intermediate the
        architecture's aux_losses hook reads after the forward pass."""
        def body(carry, state):
            x, total = carry
            x, _, aux = one_layer(x, state, None, *extras)
            return (x, jax.tree.map(jnp.add, total, aux)), None

        (x_BSD, total), _ = jax.lax.scan(body, (x_BSD, self.layers.aux_zeros()), layer_state)
        self.layer_aux = nnx.Intermediate(total)
        return x_BSD


def head_nll_sum(cfg: ModelConfig, execution: ExecutionConfig, head_params, x_BSD, targets_BS,
                 loss_chunk: int, *, rows: str = "batch"):
    """Final norm, output layer and cross-entropy of the last layer's output: the summed
    float32 loss. head_params = (final norm scale, output weight [d, vocab]); rows: the
    logical name the batch rows are sharded by (see loss_rows)."""
    norm_scale, w_DV = head_params
    dt = jnp.dtype(execution.dtype)
    h_BSD = rms_norm(x_BSD, norm_scale, cfg.norm_eps)
    B, S, _ = h_BSD.shape
    chunk = chunk_positions(S // seq_split(S), B // batch_shards(rows), loss_chunk)
    # The output layer stays in the compute dtype under every FP8 recipe (its logits feed the
    # softmax directly); 'highest' keeps its meaning here too.
    precision = "highest" if execution.matmul_precision == "highest" else "default"
    # execution.grad_reduce_dtype=float32: the weight enters in its own dtype, and its gradient
    # (summed in float32 over the chunks) leaves in it, so FSDP reduces it in float32.
    w_DV = w_DV if execution.grad_reduce_dtype == "float32" else w_DV.astype(dt)
    return linear_cross_entropy_sum(h_BSD.astype(dt), w_DV, targets_BS, chunk=chunk,
                                    precision=precision, rows=rows)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype) -> dict:
    """An empty KV cache {'k', 'v'}: [layers, batch, max_len, kv_heads, head_dim] each, in
    dtype (the compute dtype, execution.dtype)."""
    dtype = jnp.dtype(dtype)
    shape = (cfg.n_layers, batch, max_len, cfg.n_kv_heads, cfg.resolved_head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}
