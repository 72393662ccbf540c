"""The model section: the architecture's dimensions and how its weights are computed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pallas_kernels.flash_attention.backends import BACKENDS as _ATTENTION_BACKENDS
from pallas_kernels.fp8.backends import MX_SCALE_ROUNDINGS as _MX_SCALE_ROUNDINGS
from pallas_kernels.fp8.backends import RECIPES as FP8_RECIPES
from titanax.config.errors import check_choice, check_positive, check_types, fail

# Backend and recipe names come from the kernels' tables (plain data: no jax imported here).
# 'auto': pallas_kernels.flash_attention picks the kernel by GPU generation (xla on a CPU).
ATTENTION_IMPLS = (*_ATTENTION_BACKENDS, "auto")
# FP8 recipes (pallas_kernels/fp8): the attention projections and the MLP run FP8 GEMMs; the
# embedding, output layer, norms and softmax stay in model.dtype.
MATMUL_PRECISIONS = ("default", "highest", *FP8_RECIPES)
MXFP8_SCALE_ROUNDINGS = _MX_SCALE_ROUNDINGS
DTYPES = ("float32", "bfloat16", "float16")
# full_offload: full remat whose saved layer inputs go to pinned host memory.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "full_offload")
ROPE_SCALINGS = ("none", "llama3")
GRAD_REDUCE_DTYPES = ("compute", "float32")
CONTEXT_STRATEGIES = ("ring", "all_gather")


def _execution(default):
    """A ModelConfig field that says how the weights are computed, not what they are: a run may
    resume a checkpoint with another value (checkpoint/orbax_io.check_same_model compares the
    others). Where a value puts something in the train state (fp8_delayed's amax histories),
    the checkpoint check knows."""
    return field(default=default, metadata={"execution": True})


@dataclass(frozen=True)
class ModelConfig:
    # The architecture (a key of models/registry.py ARCHS), checked against the registry
    # when the model is built (titanax.config imports no model package). The fields below are its
    # dimensions; a preset (titanax.models.preset) sets them all, arch included.
    arch: str = "llama3"
    vocab_size: int = 4096
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int = 0  # 0: d_model // n_heads
    ffn_dim: int = 768
    rope_theta: float = 500000.0
    # Llama 3.1 frequency scaling: long wavelengths divided by rope_factor, short ones kept,
    # a smooth blend between (models/common/layers.py rope_inv_freq).
    rope_scaling: str = "llama3"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 2048
    norm_eps: float = 1e-5
    # The output layer is the input embedding transposed (Llama 3.2 1B/3B): no
    # separate 'output' parameter; HF export writes tie_word_embeddings and no lm_head.
    tie_embeddings: bool = False
    init_std: float = _execution(0.02)  # a new run's weights only
    attention_impl: str = _execution("xla")
    # With mesh.context > 1, how attention reaches the other devices' keys: 'ring' (K/V
    # blocks passed around with ppermute, each transfer hidden under the attention of the
    # block before) or 'all_gather' (K/V gathered once per layer: one collective instead of
    # context - 1 dependent ones; better for short local sequences and GQA's small K/V).
    context_strategy: str = _execution("ring")
    # Tensor-parallel overlap (TorchTitan's async TP, MaxText's collective matmul): with
    # mesh.tensor > 1, each sequence-parallel all-gather / reduce-scatter runs as tensor-ring
    # steps beside the column / row matmul's GEMMs (parallel/collective_matmul.py).
    tp_overlap: bool = _execution(False)
    matmul_precision: str = _execution("default")
    # Steps of amax history per tensor for fp8_delayed: Transformer Engine's DelayedScaling
    # default (amax_history_len=1024). Memory: 3 x 1024 float32 per FP8 call site per layer,
    # 7 sites: 84 KiB a layer, 6.7 MiB for Llama-3-70B's 80 layers (replicated, checkpointed).
    fp8_amax_history: int = _execution(1024)
    # mxfp8 scale exponents: 'up' (NVIDIA's / TE's MXFP8 recipe: ceil(log2(amax / 448)), the
    # block max is never clipped) or 'floor' (OCP MX v1.0: floor(log2 amax) - 8, may saturate
    # the block max by up to 12.5%).
    mxfp8_scale_rounding: str = _execution("up")
    dtype: str = _execution("bfloat16")  # compute
    param_dtype: str = "float32"  # master weights
    remat: str = _execution("none")
    # The dtype the weight gradients are summed and reduce-scattered in: 'compute' (the
    # backward's weight-gradient dots run in model.dtype, and XLA reduce-scatters them in it:
    # half the bytes) or 'float32' (summed and reduced in float32, TorchTitan's default; twice
    # the reduce-scatter traffic). FP8 recipes keep their own gradient dtypes.
    grad_reduce_dtype: str = _execution("compute")

    @classmethod
    def execution_fields(cls) -> tuple[str, ...]:
        """The fields a resumed run may change (_execution); the rest are the architecture."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("execution"))

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def __post_init__(self):
        check_types("model", self)
        if not self.arch:  # the name itself is checked by models/registry.model_spec
            fail("model.arch", "must name an architecture (models/registry.py), e.g. llama3")
        check_positive("model", self, "vocab_size", "d_model", "n_layers", "n_heads",
                       "n_kv_heads", "ffn_dim", "rope_theta", "max_seq_len", "norm_eps",
                       "fp8_amax_history")
        if self.head_dim < 0:
            fail("model.head_dim", "must be >= 0 (0 means d_model // n_heads)")
        if self.head_dim == 0 and self.d_model % self.n_heads:
            fail("model.d_model", f"{self.d_model} is not divisible by model.n_heads="
                 f"{self.n_heads}; change one of them or set model.head_dim explicitly")
        if self.resolved_head_dim % 2:
            fail("model.head_dim", f"rotary embeddings need an even head dim, got "
                 f"{self.resolved_head_dim}")
        if self.n_heads % self.n_kv_heads:
            fail("model.n_kv_heads", f"model.n_heads={self.n_heads} must be a multiple of "
                 f"model.n_kv_heads={self.n_kv_heads} (grouped-query attention)")
        check_choice("model.attention_impl", self.attention_impl, ATTENTION_IMPLS)
        check_choice("model.context_strategy", self.context_strategy, CONTEXT_STRATEGIES)
        check_choice("model.matmul_precision", self.matmul_precision, MATMUL_PRECISIONS)
        check_choice("model.mxfp8_scale_rounding", self.mxfp8_scale_rounding,
                     MXFP8_SCALE_ROUNDINGS)
        check_choice("model.dtype", self.dtype, DTYPES)
        check_choice("model.param_dtype", self.param_dtype, DTYPES)
        check_choice("model.remat", self.remat, REMAT_POLICIES)
        check_choice("model.grad_reduce_dtype", self.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
        check_choice("model.rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if self.rope_scaling == "llama3":
            check_positive("model", self, "rope_factor", "rope_low_freq_factor",
                           "rope_high_freq_factor", "rope_original_max_seq_len")
            if self.rope_high_freq_factor <= self.rope_low_freq_factor:
                fail("model.rope_high_freq_factor", "must be larger than "
                     "model.rope_low_freq_factor")
