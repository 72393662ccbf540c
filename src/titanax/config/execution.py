"""The execution section: how a model's weights are computed, everything a run may change
between runs of the same weights (a resumed checkpoint is compared on the model section only,
checkpoint/compare.check_same_model). `--set model.<field>` still reaches these fields
(config/overrides.py EXECUTION_ALIASES), as do old config files that wrote them under model."""

from __future__ import annotations

from dataclasses import dataclass

from pallas_kernels.flash_attention.backends import BACKENDS as _ATTENTION_BACKENDS
from pallas_kernels.fp8.backends import MX_SCALE_ROUNDINGS as _MX_SCALE_ROUNDINGS
from pallas_kernels.fp8.backends import RECIPES as FP8_RECIPES
from titanax.config.errors import check_choice, check_positive, check_types, fail

# Backend and recipe names come from the kernels' tables (plain data: no jax imported here).
# 'auto': pallas_kernels.flash_attention picks the kernel by GPU generation (xla on a CPU).
ATTENTION_IMPLS = (*_ATTENTION_BACKENDS, "auto")
# FP8 recipes (pallas_kernels/fp8): the attention projections and the MLP run FP8 GEMMs; the
# embedding, output layer, norms and softmax stay in execution.dtype.
MATMUL_PRECISIONS = ("default", "highest", *FP8_RECIPES)
MXFP8_SCALE_ROUNDINGS = _MX_SCALE_ROUNDINGS
DTYPES = ("float32", "bfloat16", "float16")
# full_offload: full remat whose saved layer inputs go to pinned host memory.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "full_offload")
GRAD_REDUCE_DTYPES = ("compute", "float32")
CONTEXT_STRATEGIES = ("ring", "all_gather")


@dataclass(frozen=True)
class ExecutionConfig:
    attention_impl: str = "xla"  # an attention backend (pallas_kernels BACKENDS) or auto
    # Check auto's kernel against the reference on this GPU before step 1 when measured.py has
    # no record of it (false: skip). A subprocess, < 30 s, its verdict cached in
    # train.compilation_cache; a kernel that fails is replaced by cuDNN for the run
    # (titanax/train/attention_check.py).
    attention_check: bool = True
    # With mesh.context > 1, how attention reaches the other devices' keys: 'ring' (K/V
    # blocks passed around with ppermute, each transfer hidden under the attention of the
    # block before) or 'all_gather' (K/V gathered once per layer: one collective instead of
    # context - 1 dependent ones; better for short local sequences and GQA's small K/V).
    context_strategy: str = "ring"
    # Tensor-parallel overlap (TorchTitan's async TP, MaxText's collective matmul): with
    # mesh.tensor > 1, each sequence-parallel all-gather / reduce-scatter runs as tensor-ring
    # steps beside the column / row matmul's GEMMs (parallel/collective_matmul.py).
    tp_overlap: bool = False
    # The GPU layer loop double-buffered (XLA's xla_gpu_enable_while_loop_double_buffering,
    # titanax/xla_flags.py): unrolled by two, so layer i+1's pipelined weight all-gather
    # fills a second buffer while layer i computes. false: one buffer, two fewer layer-sized
    # MLP buffers at the peak, the gather less hidden (the memory check's speed-for-memory
    # trade, titanax/plan/fit.py). No effect on a CPU.
    loop_double_buffering: bool = True
    matmul_precision: str = "default"  # default (compute dtype), highest, or an FP8 recipe
    # Steps of amax history per tensor for fp8_delayed: Transformer Engine's DelayedScaling
    # default (amax_history_len=1024). Memory: 3 x 1024 float32 per FP8 call site per layer,
    # 7 sites: 84 KiB a layer, 6.7 MiB for Llama-3-70B's 80 layers (replicated, checkpointed;
    # a resume may change it only away from fp8_delayed).
    fp8_amax_history: int = 1024
    # mxfp8 scale exponents: 'up' (NVIDIA's / TE's MXFP8 recipe: ceil(log2(amax / 448)), the
    # block max is never clipped) or 'floor' (OCP MX v1.0: floor(log2 amax) - 8, may saturate
    # the block max by up to 12.5%).
    mxfp8_scale_rounding: str = "up"
    dtype: str = "bfloat16"  # compute (the master weights' dtype is model.param_dtype)
    remat: str = "none"  # recompute in the backward: none, full, dots, dots_no_batch, full_offload
    # The dtype the weight gradients are summed and reduce-scattered in: 'compute' (the
    # backward's weight-gradient dots run in execution.dtype, and XLA reduce-scatters them in
    # it: half the bytes) or 'float32' (summed and reduced in float32, TorchTitan's default;
    # twice the reduce-scatter traffic). FP8 recipes keep their own gradient dtypes.
    grad_reduce_dtype: str = "compute"
    init_std: float = 0.02  # a new run's weights only
    # Mixture of experts with mesh.expert > 1: the rows a device may send to each expert
    # device, as a multiple of its (token, expert) pairs / mesh.expert (GShard's capacity
    # factor; pairs past it are dropped and counted in the step log as aux/dropped_fraction).
    # 0: dropless (room for every pair on one device: mesh.expert times the all-to-all buffers
    # of a factor of 1). A resume may change it: it decides what is computed, not the weights.
    expert_capacity_factor: float = 0.0

    def __post_init__(self):
        check_types("execution", self)
        check_positive("execution", self, "fp8_amax_history")
        check_choice("execution.attention_impl", self.attention_impl, ATTENTION_IMPLS)
        check_choice("execution.context_strategy", self.context_strategy, CONTEXT_STRATEGIES)
        check_choice("execution.matmul_precision", self.matmul_precision, MATMUL_PRECISIONS)
        check_choice("execution.mxfp8_scale_rounding", self.mxfp8_scale_rounding,
                     MXFP8_SCALE_ROUNDINGS)
        check_choice("execution.dtype", self.dtype, DTYPES)
        check_choice("execution.remat", self.remat, REMAT_POLICIES)
        check_choice("execution.grad_reduce_dtype", self.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
        if self.expert_capacity_factor < 0:
            fail("execution.expert_capacity_factor",
                 f"must be >= 0 (0: dropless), got {self.expert_capacity_factor}")
