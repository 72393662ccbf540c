"""Peak dense throughput per GPU, used for MFU (and by the planner). Sources: NVIDIA's H100/H200
datasheets (SXM, dense, no sparsity) and the DGX B200 / GB200 NVL72 datasheets (per GPU, dense)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s


HARDWARE = {
    "h100": Hardware("H100 SXM", 989e12, 1979e12, 80e9, 3.35e12),
    "h200": Hardware("H200 SXM", 989e12, 1979e12, 141e9, 4.8e12),
    "b200": Hardware("B200", 2.25e15, 4.5e15, 180e9, 8.0e12),
    "gb200": Hardware("GB200", 2.5e15, 5.0e15, 186e9, 8.0e12),
}


def lookup_device(device_kind: str) -> Hardware | None:
    """Matches jax's device_kind (e.g. 'NVIDIA H100 80GB HBM3') to the table; None if unknown."""
    kind = device_kind.lower().replace(" ", "")
    for key in ("gb200", "b200", "h200", "h100"):
        if key in kind:
            return HARDWARE[key]
    return None
