"""Hardware topology -> device mesh with axes (pipeline, data, fsdp, context, tensor), outer to
inner.

Devices (sorted by process, then id) are cut into NVLink domains of mesh.nvlink_domain
consecutive devices (default: the devices of one process, i.e. one HGX node). Inside a domain
sit tensor, then as much of context (then fsdp, data, pipeline) as fits; the rest of each axis
spans domains over InfiniBand. Every axis is split as outer (across domains) x inner (inside),
the layout of mesh_utils.create_hybrid_device_mesh, so a collective over an axis that crosses
domains links devices with the same local rank: each cross-domain ring stays on one rail.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from titanax.config import Config, ConfigError, MeshConfig, check_parallel_layout
from titanax.parallel.rules import MESH_AXES

# Filled inside a domain in this order: tensor first (its all-reduces are on the critical path
# of every layer), then expert (two all-to-alls of the MoE layers' tokens every layer), then
# context (K/V blocks pass around its ring inside every attention), then
# fsdp (parameter all-gathers every layer), then data and pipeline.
_INNER_FILL_ORDER = ("tensor", "expert", "context", "fsdp", "data", "pipeline")


@dataclasses.dataclass(frozen=True)
class Topology:
    domain_size: int  # devices per NVLink domain
    inner: dict[str, int]  # per axis: the part inside a domain
    outer: dict[str, int]  # per axis: the part across domains
    domains: tuple[tuple[int, ...], ...]  # device ids of each domain


_TOPOLOGIES: dict[Mesh, Topology] = {}  # what build_mesh decided, for describe_mesh


def resolve_degrees(cfg: MeshConfig, n_devices: int) -> dict[str, int]:
    degrees = {a: getattr(cfg, a) for a in MESH_AXES}
    fixed = math.prod(d for d in degrees.values() if d != -1)
    fill = [a for a, d in degrees.items() if d == -1]
    if fill:
        if n_devices % fixed:
            raise ConfigError(
                f"mesh: the fixed degrees {({a: d for a, d in degrees.items() if d != -1})} "
                f"multiply to {fixed}, which does not divide the {n_devices} devices; "
                f"choose degrees whose product divides {n_devices}")
        degrees[fill[0]] = n_devices // fixed
    product = math.prod(degrees.values())
    if product != n_devices:
        raise ConfigError(
            f"mesh: degrees {degrees} multiply to {product} but there are {n_devices} devices; "
            "make them multiply to the device count or set one of them to -1")
    return degrees


def _domain_size(cfg: MeshConfig, devices) -> int:
    n = len(devices)
    if cfg.nvlink_domain:
        size = cfg.nvlink_domain
    else:  # devices per process: one node
        size = sum(d.process_index == devices[0].process_index for d in devices)
    if n % size:
        raise ConfigError(f"mesh.nvlink_domain={size} does not divide the {n} devices; set it "
                          "to the GPUs per NVLink domain (8 on HGX, up to 72 on NVL72)")
    return size


def split_degrees(degrees: dict[str, int], domain_size: int) -> tuple[dict, dict]:
    """Each axis degree -> (inner, outer) with the inner parts tiling one domain exactly."""
    if degrees["tensor"] > domain_size or domain_size % degrees["tensor"]:
        raise ConfigError(
            f"mesh.tensor={degrees['tensor']} must divide the NVLink domain of {domain_size} "
            "devices: tensor parallelism all-reduces every layer and must stay on NVLink; "
            "lower mesh.tensor (use fsdp or data for the rest) or raise mesh.nvlink_domain")
    inner, left = {}, domain_size
    for axis in _INNER_FILL_ORDER:
        inner[axis] = math.gcd(degrees[axis], left)
        left //= inner[axis]
    if left != 1:
        raise ConfigError(
            f"mesh: degrees {degrees} cannot tile NVLink domains of {domain_size} devices "
            f"(only {domain_size // left} of each domain would be used); make the degrees "
            "inside a domain multiply to mesh.nvlink_domain")
    outer = {a: degrees[a] // inner[a] for a in MESH_AXES}
    return inner, outer


def device_index_grid(degrees: dict[str, int], inner: dict[str, int],
                      outer: dict[str, int]) -> np.ndarray:
    """[pipeline, data, fsdp, context, tensor] array of device indices (index = domain * domain size +
    local rank), the layout build_mesh gives the devices; also how the planner draws them."""
    # Built on a grid whose axes are (outer pipeline, ..., tensor, inner pipeline, ...,
    # tensor), then each axis's outer and inner parts interleave (outer major).
    grid = np.arange(math.prod(degrees.values())).reshape(
        [outer[a] for a in MESH_AXES] + [inner[a] for a in MESH_AXES])
    k = len(MESH_AXES)
    grid = grid.transpose([i for a in range(k) for i in (a, a + k)])
    return grid.reshape([degrees[a] for a in MESH_AXES])


def build_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    devices = sorted(jax.devices() if devices is None else devices,
                     key=lambda d: (d.process_index, d.id))
    degrees = resolve_degrees(cfg, len(devices))
    size = _domain_size(cfg, devices)
    inner, outer = split_degrees(degrees, size)
    index = device_index_grid(degrees, inner, outer)
    device_array = np.asarray(devices, dtype=object)[index]
    mesh = Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    domains = tuple(tuple(d.id for d in devices[i:i + size]) for i in range(0, len(devices), size))
    _TOPOLOGIES[mesh] = Topology(size, inner, outer, domains)
    return mesh


def single_device_mesh() -> Mesh:
    return build_mesh(MeshConfig(data=1), devices=jax.devices()[:1])


def check_layout(cfg: Config, mesh: Mesh) -> None:
    """The checks of config.check_parallel_layout with the mesh's actual degrees (-1 resolved)."""
    check_parallel_layout(cfg, {a: mesh.shape[a] for a in MESH_AXES})


def describe_mesh(mesh: Mesh) -> str:
    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    head = f"mesh {sizes} over {mesh.size} {mesh.devices.flat[0].platform} device(s)"
    topo = _TOPOLOGIES.get(mesh)
    if topo is None:
        return head
    fmt = lambda parts: " x ".join(f"{a}={parts[a]}" for a in MESH_AXES if parts[a] > 1) or "-"
    lines = [f"{head}; {len(topo.domains)} NVLink domain(s) of {topo.domain_size}",
             f"    inside each domain (NVLink): {fmt(topo.inner)}",
             f"    across domains (InfiniBand, rail-aligned): {fmt(topo.outer)}"]
    lines += [f"    domain {i}: devices {list(ids)}" for i, ids in enumerate(topo.domains)]
    if len(topo.domains) > 1:
        rails = [[dom[r] for dom in topo.domains] for r in range(topo.domain_size)]
        lines.append("    rails (same local rank): " + ", ".join(map(str, rails)))
    return "\n".join(lines)
