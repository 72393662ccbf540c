"""The XLA flags of a GPU training run, in one place.

`launch.train` applies them on GPU and `launch.plan` to its deviceless GPU compiles, so the
step the planner measures is scheduled, combined and buffered as the one that runs (the
latency-hiding scheduler and pipelined collectives move the memory peak). XLA reads XLA_FLAGS
once, when its first backend starts: set them before jax computes anything. An unknown flag
aborts XLA at start-up; XLA knows its GPU flags on every platform, so tests check the names
against this jaxlib on a CPU.
"""

from __future__ import annotations

import importlib.util
import os

from pallas_kernels.fp8.backends import XLA_GPU_FLAGS  # plain data: no jax

# Overlapping communication with compute (flag names checked against jaxlib 0.11.2).
GPU_FLAGS = (
    # Schedule async collectives to overlap independent compute (the base of all overlap).
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # FSDP: all-gather layer i+1's weights during layer i of the layer loop...
    "--xla_gpu_enable_pipelined_all_gather=true",
    # ...and reduce-scatter layer i's gradients during layer i-1's backward.
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    # Data-parallel gradient all-reduces likewise pipelined across layers.
    "--xla_gpu_enable_pipelined_all_reduce=true",
    # Unroll the layer loop by two so a pipelined collective has a second buffer to fill.
    "--xla_gpu_enable_while_loop_double_buffering=true",
    # Combine small collectives up to 128 MiB: fewer, larger NCCL calls use the links better.
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    # Let collectives of different tensor dims combine too (else the thresholds rarely apply).
    "--xla_gpu_enable_all_gather_combine_by_dim=false",
    "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
    # Give the collectives' stream priority so they are not starved behind compute kernels.
    "--xla_gpu_enable_highest_priority_async_stream=true",
    # Every GEMM on cuBLAS(Lt), none on XLA's Triton GEMMs: these never promote an FP8
    # accumulator, so the FP8 recipes' per-GEMM accumulation (forward fast, dgrad and wgrad
    # not: pallas_kernels/fp8/accumulation.py) holds only on cuBLASLt; and the deviceless
    # compile then shows the library call a GPU runs, not an un-autotuned Triton tile.
    *XLA_GPU_FLAGS,
)

# The flag that double-buffers the layer loop, switched per compile (not per process) by
# execution.loop_double_buffering: `compiler_options(cfg)`.
DOUBLE_BUFFERING = "xla_gpu_enable_while_loop_double_buffering"

# XLA's own tensor-parallel overlap (SPMD "windowed einsum" / collective matmul), deliberately
# NOT in GPU_FLAGS. `python -m launch.bench tp_overlap` (titanax/perf/tp_overlap.py) compiles
# the Llama-3-8B-wide train step for TP4 x DP2 H100s with and without them:
# - they change nothing on the tensor axis: ops/linear.py multiplies [B*S, K] x [K, N], so the
#   dots never see the sequence sharding (the partitioner gathers before the reshape), and
#   with the batch sharded too, XLA's all-gather loop would be the "partial" kind, whose
#   permutes run synchronously in a conditional (not hidden);
# - with FSDP (fsdp=8) the threshold 0 turns every weight all-gather and gradient
#   reduce-scatter into 8-step permute loops (279 collective-permutes instead of 17
#   all-gathers and 4 reduce-scatters for 2 layers), replacing the pipelined all-gathers above.
# The tensor-parallel collectives are hidden by parallel/collective_matmul.py instead (explicit
# ppermute rings, scheduled by the latency-hiding scheduler above; no extra flag needed).
WINDOWED_EINSUM_FLAGS = (
    "--xla_gpu_threshold_for_windowed_einsum_mib=0",  # decompose every eligible dot
    "--xla_gpu_multi_streamed_windowed_einsum=true",  # unrolled loops, GEMMs on 2 streams
)

# Set to replace GPU_FLAGS (e.g. to try a scheduler setting without editing code).
OVERRIDE_ENV = "TITANAX_XLA_FLAGS"

# The modules a jax CUDA PJRT plugin installs, CUDA 12 and CUDA 13 builds: the wheel's own
# package (jax-cuda1x-plugin) and the jax_plugins namespace entry jax discovers it through.
# The GPU image we are lent carries the CUDA 13 one; `pip install jax[cuda12]` the other.
CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_cuda12_plugin",
                       "jax_plugins.xla_cuda13", "jax_cuda13_plugin")


def gpu_flags(env=None) -> list[str]:
    env = os.environ if env is None else env
    override = env.get(OVERRIDE_ENV)
    return override.split() if override is not None else list(GPU_FLAGS)


def _name(flag: str) -> str:
    return flag.lstrip("-").split("=", 1)[0]


def with_gpu_flags(xla_flags: str, env=None) -> str:
    """xla_flags (the user's XLA_FLAGS) with the GPU flags put first; a flag the user set
    already keeps the user's value."""
    mine = {_name(f) for f in xla_flags.split()}
    ours = [f for f in gpu_flags(env) if _name(f) not in mine]
    return " ".join([*ours, *xla_flags.split()])


def runs_on_gpu(host_devices: int = 0, env=None) -> bool:
    """Whether jax will pick a GPU in a process started with this environment: not with
    simulated CPU devices, as JAX_PLATFORMS says, else when a CUDA plugin (12 or 13) is
    installed."""
    env = os.environ if env is None else env
    if host_devices:
        return False
    platforms = env.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() in ("cuda", "gpu")
    return any(_installed(m) for m in CUDA_PLUGIN_MODULES)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package (jax_plugins) is missing
        return False


def apply_for_run(host_devices: int = 0, env=None) -> bool:
    """Adds the GPU flags to env's XLA_FLAGS (default os.environ) when the run will be on a
    GPU; call before jax starts a backend. Returns whether it did."""
    env = os.environ if env is None else env
    if not runs_on_gpu(host_devices, env):
        return False
    env["XLA_FLAGS"] = with_gpu_flags(env.get("XLA_FLAGS", ""), env)
    return True


def compiler_options(cfg) -> dict:
    """The per-compile XLA options of cfg's train step, over the process's XLA_FLAGS
    (jax's `Lowered.compile(compiler_options=...)`): the layer loop single-buffered when
    execution.loop_double_buffering is false (GPU_FLAGS double-buffer it). Empty otherwise,
    so a default run compiles exactly as before; XLA:CPU ignores the GPU option."""
    if cfg.execution.loop_double_buffering:
        return {}
    return {DOUBLE_BUFFERING: False}
