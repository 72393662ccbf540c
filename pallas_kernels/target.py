"""The device a computation is traced for, which is not always the process's default backend.

A deviceless compile (pallas_kernels.aot, the planner) runs on a CPU backend but lowers for a
mesh of compile-only GPU devices set with jax.set_mesh; kernel and implementation choices must
follow those devices, or a GPU plan would be compiled with the CPU fallbacks (an S x S
attention instead of cuDNN's fused one). Without an ambient mesh: the first local device.
"""

from __future__ import annotations

import jax


def target_device():
    """A device of the ambient mesh (it carries compute_capability on GPUs), else the first
    local device. jax.sharding.get_mesh() refuses to run under jit, hence the internal twin,
    guarded so a JAX that moves it only loses the mesh lookup."""
    try:
        from jax._src.mesh import get_concrete_mesh
        mesh = get_concrete_mesh()
    except (ImportError, AttributeError):
        mesh = None
    if mesh is not None and not mesh.empty:
        return mesh.devices.flat[0]
    return jax.devices()[0]


def target_platform() -> str:
    """'gpu', 'cpu' or 'tpu' for the devices being compiled for: the ambient (abstract) mesh's
    device platform when a mesh is set, else the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is not None and not mesh.empty:
        return mesh.abstract_device.platform
    return target_device().platform


def compute_capability() -> tuple[int, int] | None:
    """(major, minor) of the target GPU (9, 0 for Hopper; 10, 0 for B200), None off GPU."""
    dev = target_device()
    cc = getattr(dev, "compute_capability", None)
    if dev.platform != "gpu" or cc is None:
        return None
    major, minor = str(cc).split(".")[:2]
    return int(major), int(minor)


def sm_count() -> int | None:
    """The target GPU's SM count (132 on H100 SXM, 114 on H100 PCIe, 148 on B200; a
    deviceless compile's comes from its target config), None off GPU."""
    dev = target_device()
    return getattr(dev, "core_count", None) if dev.platform == "gpu" else None


def out_struct(like, shape, dtype):
    """A kernel output's ShapeDtypeStruct, varying over the same manual mesh axes as the input
    `like`: inside jax.shard_map (a pipeline stage) pallas_call must be told, or it refuses."""
    manual = getattr(jax.typeof(like), "manual_axis_type", None)
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=manual)


def match_varying(x, like):
    """x cast to vary over every manual mesh axis `like` varies over (inside jax.shard_map):
    a kernel's operands must agree, and a cotangent (e.g. of a sum) may arrive invariant."""
    want = getattr(jax.typeof(like).manual_axis_type, "varying", frozenset())
    have = getattr(jax.typeof(x).manual_axis_type, "varying", frozenset())
    missing = tuple(sorted(want - have))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
