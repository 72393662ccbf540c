"""Global batches from process-local rows: which rows a process loads, and how they become one
array sharded over the batch axis."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from titanax.config import ConfigError


def process_rows(sharding: NamedSharding, global_bs: int, seq_len: int) -> slice:
    """The rows of each global batch that this process's devices hold: the only rows it
    loads. Usually a contiguous block (build_mesh orders devices by process); all rows where
    processes replicate the batch (pipeline stages on different hosts)."""
    rows = set()
    for index in sharding.addressable_devices_indices_map((global_bs, seq_len)).values():
        rows.update(range(*index[0].indices(global_bs)))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ConfigError(f"this process's devices hold non-contiguous batch rows {sorted(rows)}; "
                          "use a mesh whose data/fsdp axes give each process one block of rows "
                          "(mesh.nvlink_domain = devices per process)")
    return slice(lo, hi)


def global_batch(batch: dict, sharding: NamedSharding, global_batch_size: int) -> dict:
    """Process-local rows -> one global array per key, sharded over the batch axis."""
    out = {}
    for k, v in batch.items():
        shape = (global_batch_size, *v.shape[1:])
        out[k] = jax.make_array_from_process_local_data(sharding, np.asarray(v), shape)
    return out
