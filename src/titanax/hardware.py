"""Per-GPU hardware numbers, used for MFU and by the planner (titanax.plan).

Compute and memory: NVIDIA's H100/H200 datasheets (SXM, dense, no sparsity) and the DGX B200 /
GB200 NVL72 datasheets (per GPU, dense). Interconnect, per GPU and per direction:
- NVLink: H100/H200 SXM have NVLink 4, 18 links, 900 GB/s bidirectional -> 450 GB/s each way;
  B200/GB200 have NVLink 5, 1.8 TB/s bidirectional -> 900 GB/s each way (datasheets).
- InfiniBand: one rail NIC per GPU. DGX/HGX H100, H200 and B200 carry eight ConnectX-7
  400 Gb/s NICs (one per GPU) -> 50 GB/s per GPU; the DGX GB200 datasheet lists ConnectX-7
  400 Gb/s per GPU as well (ConnectX-8 800 Gb/s arrives with GB300).
- NVLink domain: 8 GPUs on an HGX/DGX baseboard; 72 in a GB200 NVL72 rack, whose nodes
  (compute trays) hold 4 GPUs each, so an NVLink domain spans 18 nodes there.
- Host link (what host offload of optimizer state, weights or activations moves over), per GPU
  and per direction: H100/H200 SXM and B200 (HGX/DGX) connect each GPU to the CPU by PCIe Gen5
  x16, 128 GB/s bidirectional on their datasheets -> 64 GB/s each way; a GB200 superchip joins
  one Grace CPU to its two Blackwell GPUs by NVLink-C2C, 900 GB/s bidirectional (GB200 NVL72
  datasheet) -> 225 GB/s per GPU each way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float = 0.0  # bytes/s per GPU, one direction
    ib_rail_bandwidth: float = 0.0  # bytes/s of the GPU's own rail NIC, one direction
    nvlink_domain: int = 8  # GPUs that reach each other over NVLink
    gpus_per_node: int = 8  # GPUs per host (process)
    host_bandwidth: float = 64e9  # bytes/s between the GPU and pinned host memory, one direction


HARDWARE = {
    "h100": Hardware("H100 SXM", 989e12, 1979e12, 80e9, 3.35e12,
                     nvlink_bandwidth=450e9, ib_rail_bandwidth=50e9, nvlink_domain=8),
    "h200": Hardware("H200 SXM", 989e12, 1979e12, 141e9, 4.8e12,
                     nvlink_bandwidth=450e9, ib_rail_bandwidth=50e9, nvlink_domain=8),
    "b200": Hardware("B200", 2.25e15, 4.5e15, 180e9, 8.0e12,
                     nvlink_bandwidth=900e9, ib_rail_bandwidth=50e9, nvlink_domain=8),
    "gb200": Hardware("GB200", 2.5e15, 5.0e15, 186e9, 8.0e12,
                      nvlink_bandwidth=900e9, ib_rail_bandwidth=50e9, nvlink_domain=72,
                      gpus_per_node=4, host_bandwidth=225e9),
}


def lookup_device(device_kind: str) -> Hardware | None:
    """Matches jax's device_kind (e.g. 'NVIDIA H100 80GB HBM3') to the table; None if unknown."""
    kind = device_kind.lower().replace(" ", "")
    for key in ("gb200", "b200", "h200", "h100"):
        if key in kind:
            return HARDWARE[key]
    return None
