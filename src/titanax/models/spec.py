"""What the rest of titanax asks of a model architecture: one ModelSpec per folder under
models/, registered by name in models/registry.py and chosen by `model.arch`.

State creation, the train loop, sampling, HF import/export, the planner and the FLOP formula
ask the spec; none of them imports a model class."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from titanax.config import ModelConfig

FLOP_FORMULA = ("FLOPs/token = 6*N + 12*L*d*S (N: params without input embedding; "
                "d: attention width n_heads*head_dim, = d_model for Llama)")


def flops_per_token(model: ModelConfig, seq_len: int, n_params_no_embed: int) -> float:
    """6*N + 12*L*d*S: N the parameters without the input embedding (the output layer counts),
    the second term attention's score and value matmuls forward and backward, causal mask not
    discounted (as NVIDIA and MaxText report MFU); d = n_heads * head_dim (d_model in Llama)."""
    width = model.n_heads * model.resolved_head_dim
    return 6.0 * n_params_no_embed + 12.0 * model.n_layers * width * seq_len


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    arch: str  # the model.arch value
    # build(cfg, rngs) -> an nnx.Module with __call__(tokens_BS, positions_BS, segment_ids_BS,
    # cache, cache_index, pipeline) -> (logits_BSV, cache) and loss_sum(tokens_BS, targets_BS,
    # positions_BS, segment_ids_BS, *, pipeline, loss_chunk) -> float32 sum of token NLLs.
    build: Callable[..., Any]
    # init_cache(cfg, batch, max_len, dtype=None) -> the KV cache __call__ takes
    init_cache: Callable[..., Any]
    presets: Mapping[str, dict]  # preset name -> ModelConfig fields
    # The model's HF interop (models/hf_interop.HFInterop: tensor table, config.json both ways);
    # None: the architecture cannot be imported or exported.
    hf: Any = None

    def count_params(self, cfg: ModelConfig, *, exclude_embedding: bool = False) -> int:
        """Exact parameter count from nnx.eval_shape: nothing is allocated. FP8 scaling state is
        not a parameter. exclude_embedding: without the input embedding (tied embeddings count
        once, as the output layer)."""
        import jax
        from flax import nnx

        from titanax.parallel.mesh import single_device_mesh
        from titanax.parallel.rules import model_context

        with model_context(single_device_mesh()):
            abstract = nnx.eval_shape(lambda: self.build(cfg, rngs=nnx.Rngs(0)))
        state = nnx.state(abstract, nnx.Param)  # (ops.Fp8Meta is a Variable of its own)
        total = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
        if exclude_embedding and not getattr(cfg, "tie_embeddings", False):
            total -= cfg.vocab_size * cfg.d_model
        return total

    def flops_per_token(self, cfg: ModelConfig, seq_len: int) -> float:
        """FLOP_FORMULA for this architecture at cfg's dimensions."""
        return flops_per_token(cfg, seq_len, self.count_params(cfg, exclude_embedding=True))
