"""Deviceless (ahead-of-time) GPU compiles: lower and compile for an H100, H200, B200 or GB200 on
a CPU box.

Needs the CUDA PJRT plugin (`jax-cuda12-plugin[with-cuda]`, pinned in constraints-cuda.txt)
importable, which scripts/dev.sh installs into .venv/cuda-plugin, outside the main environment
so ordinary runs never probe for CUDA. Run in a process with JAX_PLATFORMS=cpu and that folder
on sys.path (`cuda_plugin_env()` builds such an environment for a subprocess):

    topo = gpu_topology("h100")                      # compile-only devices, 8 per host
    compiled = compile_for("h100", fn, *abstract_args)  # jax.stages.Compiled; raises on failure

The target configs are XLA's GpuTargetConfigProto text: the chip's SM count, shared memory
(the 227 KiB opt-in per block is what a Pallas/Mosaic kernel may use, so an over-budget kernel
fails the compile as it would on the chip), registers, clocks, and the compute capability that
picks sm_90a / sm_100a code generation.

Here in pallas_kernels (not titanax) because the kernels' own tests compile with it, and the
kernel package imports nothing from titanax; titanax's planner and perf tools import it too.
"""

from __future__ import annotations

import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
CUDA_PLUGIN_DIR = REPO / ".venv" / "cuda-plugin"

_DEVICE_INFO = """\
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {smem_per_sm}
  threads_per_core_limit: 2048
  core_count: {sms}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {hbm_bw}
  l2_cache_size: {l2}
  clock_rate_ghz: {clock}
  device_memory_size: {hbm}
  shared_memory_per_block_optin: {smem_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  runtime_version: "{cuda}"
  dnn_version: "{cudnn}"
}}
platform_name: "CUDA"
device_description_str: "{name}"
"""
# The CUDA runtime and cuDNN the compiler assumes, as a GPU's stream executor reports them:
# those constraints-cuda.txt pins (the plugin's own). jax 0.11.2's proto reads them from
# gpu_device_info (a top-level dnn_version_info is ignored). Without them the compiler sees
# 0.0.0 and takes paths no real GPU takes: FP8 dots upcast to f16 ("FP8 Custom Calls require
# CUDA 12.0"), MX dots dequantized into loop fusions (cuDNN's block-scaled GEMM needs 9.10).
SOFTWARE = dict(cuda="12.9.0", cudnn="9.28.0")

# Both generations' SMs: 228 KiB of shared memory, 227 KiB (232448 B) of it opt-in per block.
_SMEM = dict(smem_per_sm=233472, smem_optin=232448)
# The H100 die (H100 SXM, H200): 132 SMs, compute capability 9.0.
_HOPPER = dict(sms=132, l2=52428800, clock=1.98, major=9, minor=0, **_SMEM)
# Blackwell (B200, and GB200's GPU): compute capability 10.0, 148 SMs, 8 TB/s HBM3e.
_BLACKWELL = dict(sms=148, hbm_bw=8000000000000, l2=132120576, clock=1.965, major=10, minor=0,
                  **_SMEM)
TARGETS = {
    "h100": dict(_HOPPER, name="NVIDIA H100 80GB HBM3", hbm_bw=3352320000000, hbm=84978434048),
    # H200: the H100 die with 141 GB HBM3e.
    "h200": dict(_HOPPER, name="NVIDIA H200", hbm_bw=4800000000000, hbm=150754820096),
    "b200": dict(_BLACKWELL, name="NVIDIA B200", hbm=191514869760),
    # GB200 (Grace Blackwell superchip, NVL72): 186 GB HBM3e per GPU (GB200 NVL72 datasheet).
    "gb200": dict(_BLACKWELL, name="NVIDIA GB200", hbm=186000000000),
}


def target_config(kind: str) -> str:
    """GpuTargetConfigProto text for `kind` (h100, h200, b200, gb200)."""
    try:
        return _DEVICE_INFO.format(**TARGETS[kind.lower()], **SOFTWARE)
    except KeyError:
        raise ValueError(f"unknown GPU kind {kind!r}; known: {sorted(TARGETS)}") from None


def cuda_plugin_env(env: dict | None = None) -> dict:
    """Environment for a subprocess that compiles for GPUs without one: CPU runtime, the CUDA
    plugin folder on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["JAX_PLATFORMS"] = "cpu"
    # The GPU program as the product compiles it: no lowered optimisation level (the test
    # suite sets one for its CPU compiles, conftest.py).
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_backend_optimization_level")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(CUDA_PLUGIN_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def run_script(script: str, *args: str, timeout: int = 300):
    """Runs `python -c script args...` in a subprocess set up for deviceless compiles (the
    repo's packages and the CUDA plugin on the path, CPU runtime); its CompletedProcess."""
    import subprocess

    env = cuda_plugin_env()
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(REPO), str(REPO / "src")))
    return subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def plugin_available() -> bool:
    return (CUDA_PLUGIN_DIR / "jax_plugins" / "xla_cuda12").is_dir()


def gpu_topology(kind: str, topology: str = "1x1x8"):
    """Compile-only devices of `kind`. topology "1xHxG": H hosts of G GPUs each ("1x1x8": one
    host of 8); device d sits on process d // G, as on a real multi-host cluster."""
    if str(CUDA_PLUGIN_DIR) not in sys.path and plugin_available():
        sys.path.insert(0, str(CUDA_PLUGIN_DIR))
    from jax.experimental import topologies
    return topologies.get_topology_desc(f"{kind}-{topology}", "cuda",
                                        target_config=target_config(kind), topology=topology)


def gpu_mesh(kind: str, shape=(1,), axis_names=("x",), topology: str = "1x1x8"):
    """A jax Mesh over the first prod(shape) compile-only devices of `kind`."""
    import math

    import jax
    import numpy as np
    devices = gpu_topology(kind, topology).devices[:math.prod(shape)]
    return jax.sharding.Mesh(np.array(devices).reshape(shape), axis_names)


def compile_for(kind: str, fn, *args, mesh=None, **jit_kwargs):
    """jit(fn).lower(*args).compile() for `kind`; args are jax.ShapeDtypeStructs. Inputs are
    placed on one device of the mesh (default: a 1-device mesh of that GPU), which is also set
    as the ambient mesh, since Pallas GPU kernels read the SM count from it."""
    import jax
    mesh = gpu_mesh(kind) if mesh is None else mesh
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with jax.set_mesh(mesh):
        return jax.jit(fn, **jit_kwargs).lower(*args).compile()
