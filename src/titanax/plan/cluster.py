"""The target cluster: GPU kind, nodes, GPUs per node, and what follows from them (NVLink
domains, rails, the mesh layout of a config on it). No devices are touched here."""

from __future__ import annotations

import dataclasses

from pallas_kernels import aot
from pallas_kernels.fp8.backends import RECIPES_TABLE, mx_refusal
from titanax.config import Config, ConfigError, apply_overrides, check_parallel_layout
from titanax.hardware import HARDWARE, Hardware
from titanax.parallel.mesh import resolve_degrees, split_degrees
from titanax.parallel.rules import MESH_AXES


class PlanError(ValueError):
    """Bad planner input (unknown GPU, impossible cluster or layout); the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    gpu: str  # a key of titanax.hardware.HARDWARE
    nodes: int
    gpus_per_node: int = 0  # 0: the GPU kind's usual node (8 on HGX, 4 on a GB200 tray)

    def __post_init__(self):
        if self.gpu not in HARDWARE:
            raise PlanError(f"--gpu {self.gpu!r} is unknown; choose one of {sorted(HARDWARE)}")
        if self.nodes < 1:
            raise PlanError(f"--nodes must be >= 1, got {self.nodes}")
        if self.gpus_per_node < 0:
            raise PlanError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if not self.gpus_per_node:
            object.__setattr__(self, "gpus_per_node", self.hardware.gpus_per_node)

    @property
    def hardware(self) -> Hardware:
        return HARDWARE[self.gpu]

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def nvlink_domain(self) -> int:
        """GPUs per NVLink domain on this cluster. HGX: one node. NVL72: as many whole nodes as
        one rack holds, in equal domains (build_mesh needs equal domains), so 16 trays of 4
        form one domain of 64 and 36 trays two of 72."""
        hw = self.hardware
        if hw.nvlink_domain <= self.gpus_per_node:
            return self.gpus_per_node
        per_rack = hw.nvlink_domain // self.gpus_per_node
        nodes = max(k for k in range(1, min(per_rack, self.nodes) + 1) if self.nodes % k == 0)
        return nodes * self.gpus_per_node

    @property
    def topology(self) -> str:
        """jax.experimental.topologies string: 1 slice x nodes x GPUs per node."""
        return f"1x{self.nodes}x{self.gpus_per_node}"

    def describe(self) -> str:
        hw = self.hardware
        return (f"{self.nodes} node(s) x {self.gpus_per_node} {hw.name} = {self.n_gpus} GPUs, "
                f"NVLink domains of {self.nvlink_domain}, one {hw.ib_rail_bandwidth * 8 / 1e9:.0f}"
                f" Gb/s InfiniBand rail per GPU")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A config's mesh on a cluster: degrees per axis and their split into the part inside an
    NVLink domain (inner) and across domains over InfiniBand (outer), as build_mesh does it."""
    degrees: dict[str, int]
    inner: dict[str, int]
    outer: dict[str, int]
    domain_size: int

    def describe(self) -> str:
        parts = [f"{a}={self.degrees[a]}" for a in MESH_AXES if self.degrees[a] > 1]
        return " x ".join(parts) or "1 device"


def plan_config(cfg: Config, cluster: Cluster) -> Config:
    """cfg with mesh.nvlink_domain set to the cluster's (unless the config pins one); a
    recipe the GPU cannot run (mxfp8 before Blackwell) is refused before anything compiles."""
    recipe, target = RECIPES_TABLE.get(cfg.execution.matmul_precision), aot.TARGETS[cluster.gpu]
    if recipe is not None and recipe.scaling == "mx" and (
            why := mx_refusal((target["major"], target["minor"]))):
        raise PlanError(f"--gpu {cluster.gpu}: {why}")
    if cfg.mesh.nvlink_domain:
        return cfg
    return apply_overrides(cfg, {"mesh.nvlink_domain": cluster.nvlink_domain})


def layout_for(cfg: Config, cluster: Cluster) -> Layout:
    """The mesh cfg gets on the cluster; ConfigError (naming the field) when it cannot tile."""
    degrees = resolve_degrees(cfg.mesh, cluster.n_gpus)
    check_parallel_layout(cfg, degrees)
    size = cfg.mesh.nvlink_domain or cluster.nvlink_domain
    if cluster.n_gpus % size:
        raise ConfigError(f"mesh.nvlink_domain={size} does not divide the {cluster.n_gpus} GPUs")
    inner, outer = split_degrees(degrees, size)
    return Layout(degrees, inner, outer, size)

