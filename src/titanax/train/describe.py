"""Lines the run log opens with: parameters, FLOPs, processes, mesh, data, memory."""

from __future__ import annotations

import jax

from titanax.train import metrics as M


def describe_processes() -> str:
    n = jax.process_count()
    if n == 1:
        return "1 process"
    return (f"{n} processes (jax.distributed), {jax.local_device_count()} local device(s) "
            "each; this log is process 0's")


def describe_accumulation(cfg, pipeline_stages: int = 1) -> str | None:
    """How train.grad_accum sums the microbatches' gradients (None without accumulation);
    pipeline_stages: the mesh's, which mesh.pipeline=-1 leaves to the mesh (train/step.py)."""
    from titanax.config import grad_accum_in_place_unsupported

    if cfg.train.grad_accum == 1:
        return None
    why = grad_accum_in_place_unsupported(cfg)
    if why is None and pipeline_stages > 1:
        why = "pipeline parallelism: the stages run their own backward schedule"
    if why is None:
        return (f"grad_accum {cfg.train.grad_accum}: gradients summed in place (one float32 "
                "buffer, models/accumulate.py)")
    return (f"grad_accum {cfg.train.grad_accum}: gradients summed the plain way (a fresh "
            f"gradient buffer per microbatch beside the sum): {why}")


def describe_memory(compiled) -> str:
    try:
        return M.describe_compiled_memory(compiled)
    except Exception as e:  # noqa: BLE001 - a backend without the analysis still trains
        return f"memory analysis unavailable ({type(e).__name__})"
