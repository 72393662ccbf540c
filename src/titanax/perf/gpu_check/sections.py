"""The sections of gpu_check, in order: what each runs (a function of a SectionContext, imported
in the section's own process), its time budgets, and the environment it needs."""

from __future__ import annotations

import dataclasses

# The whole run's worst case, kills included (runner.py): with scripts/gpu_loan.sh's preflight
# (at most 30 s to start the GPU backend) the loan command ends within 545 s, inside the
# device tool's timeout_s=570 (docs/gpu_check.md). The default sections' budgets add up to
# 470 s; the rest is one Python process start-up per section (jax import, CUDA context).
DEFAULT_TIME_LIMIT_S = 510.0


@dataclasses.dataclass(frozen=True)
class Section:
    name: str
    fn: str  # "module:function(ctx)", imported in the child
    budget_s: float  # the GPU run, at DEFAULT_TIME_LIMIT_S (scaled with --time-limit)
    dry_budget_s: float
    what: str
    cache: bool = True  # may use the persistent compilation cache (ptxas must compile)
    env: tuple = ()  # (name, default) set in the child when the user has not


_P = "titanax.perf.gpu_check."
SECTIONS = (
    Section("device", _P + "device:device_section", 15, 30,
            "jax/jaxlib/plugin versions, device kind, compute capability, memory (allocator "
            "limit and datasheet), CUDA/cuDNN/driver versions, datasheet peaks."),
    Section("ptxas", _P + "device:ptxas_section", 45, 20,
            "ptxas reports of our kernels compiled for this GPU (titanax.perf.ptxas_report "
            "collect/check): registers, spills, shared memory per kernel and head_dim.",
            # collect() compiles in a process of its own on the same GPU: neither may grab
            # 75% of its memory up front.
            cache=False, env=(("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),)),
    Section("kernels", _P + "kernels:kernels_section", 60, 100,
            "Flash attention (value and dq/dk/dv) and FP8 matmul impls against their jnp "
            "references at the shipped configs. Attention error = max|x-ref|/max|ref| per "
            "tensor < 2e-2; FP8: |x-ref| <= 8e-3*(|ref| + max|ref|)."),
    Section("attention", _P + "throughput:attention_section", 65, 60,
            "Attention fwd/bwd TFLOP/s, our kernel vs cuDNN, Hq 64 / Hkv 8 / D 128, causal, "
            "bf16, 16384 tokens per call. FLOPs: fwd = 4*B*S^2*Hq*D/2, bwd = 2.5*fwd."),
    Section("fp8", _P + "throughput:fp8_section", 30, 60,
            "FP8 and MXFP8 GEMMs vs XLA bf16 and XLA FP8 at M=8192 and the 70B (K, N): "
            "(8192, 8192), (8192, 28672), (28672, 8192). FLOPs = 2*M*N*K."),
    Section("train", _P + "train_step:train_section", 210, 120,
            "Train step of Llama-3-70B cut to the layers that fit (seq 8192, full remat, "
            "AdamW), bf16 and FP8 recipes: tokens/s, MFU = tokens/s * (6*N + 12*L*d*S) / "
            "dense bf16 peak.",
            # JAX takes 75% of HBM by default; the step's train state needs more.
            env=(("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92"),)),
    Section("choices", _P + "choices:choices_section", 90, 90,
            "Each kernel choice made without a GPU against its alternative (choices.py): the "
            "sm90 fused backward (shipped) against the dq and dkv kernels at head_dim 128 and "
            "64, the FA3/FA4 forms of the attention kernels, FP8 structure, promotion and "
            "tile, Triton warps at head_dim 64 and backward stages at 256, "
            "packed documents on our kernel or cuDNN with a dense mask. vs_shipped = shipped "
            "time / variant time."),
)
NAMES = tuple(s.name for s in SECTIONS)
# What a loan runs, most valuable first: a loan cut short keeps the numbers that matter most.
# Kernels' values before any timing (a wrong or hanging kernel is then skipped by the timing
# sections); the shipped step (cuDNN first) before the kernel-level rows. ptxas only on request:
# the deviceless report (launch.ptxas_report, tests/test_ptxas_report.py) compiles the same
# kernels for the same GPUs.
DEFAULT_ORDER = ("device", "kernels", "train", "attention", "fp8", "choices")
