"""Device mesh with axes (pipeline, data, fsdp, tensor), outermost to innermost.

tensor is innermost so that tensor-parallel groups are consecutive devices (one NVLink domain on
a GPU node); data and pipeline are outermost so their collectives cross domains. Degrees of -1
take the devices that are left.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from titanax.config import ConfigError, MeshConfig
from titanax.parallel.rules import MESH_AXES


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


def build_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    degrees = resolve_degrees(cfg, len(devices))
    shape = tuple(degrees[a] for a in MESH_AXES)
    device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def single_device_mesh() -> Mesh:
    return build_mesh(MeshConfig(data=1), devices=jax.devices()[:1])


def describe_mesh(mesh: Mesh) -> str:
    sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)
    return f"mesh {sizes} over {mesh.size} {mesh.devices.flat[0].platform} device(s)"
