"""Does the compiled train step fit the devices' memory? Answered before the first step runs,
from the step compiled for abstract inputs (ShapeDtypeStructs: nothing is allocated), so a run
that cannot fit stops in seconds, naming the need, instead of in an out-of-memory error deep in
its first step. The search for a change that fits is the planner's (titanax/plan/fit.py).

compiled_memory is the one reading of XLA's memory figures for a compiled step: this check,
the run log's opening line (train/run_log.py) and the planner use it."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from titanax import xla_flags
from titanax.config import Config, ConfigError
from titanax.parallel.rules import batch_input_spec, model_context
from titanax.train.optim import lr_schedule, make_optimizer
from titanax.train.resolved import resolve
from titanax.train.state import abstract_train_state, jit_train_step


class DoesNotFit(ConfigError):
    """The train step needs more memory per device than there is; the message names the
    need, the capacity and (when one was found) the --set that fits."""



def compiled_memory(compiled) -> dict[str, int]:
    """Bytes per device of a compiled executable (memory_analysis): arguments, outputs,
    aliased outputs (the donated state, which takes no new memory), temporaries, their
    'total' = arguments + outputs - aliased + temporaries, and the same for pinned host
    memory (train.offload_*, remat full_offload: XLA reports it apart). The one reading of
    XLA's numbers: the step log, the memory check and the planner use it."""
    mem = compiled.memory_analysis()
    get = lambda name: int(getattr(mem, name, 0) or 0)
    out = {}
    for prefix in ("", "host_"):
        args, outs, alias, temp = (get(f"{prefix}argument_size_in_bytes"),
                                   get(f"{prefix}output_size_in_bytes"),
                                   get(f"{prefix}alias_size_in_bytes"),
                                   get(f"{prefix}temp_size_in_bytes"))
        out.update({f"{prefix}arguments": args, f"{prefix}outputs": outs,
                    f"{prefix}aliased": alias, f"{prefix}temporaries": temp,
                    f"{prefix}total": args + outs - alias + temp})
    return out


def describe_compiled_memory(compiled) -> str:
    """The compiled step's memory per device from XLA's buffer assignment, before it runs."""
    if compiled.memory_analysis() is None:
        return "memory analysis: not reported by this backend"
    m = {k: v / 2**30 for k, v in compiled_memory(compiled).items()}
    text = (f"memory per device: {m['total']:.3f} GiB = arguments {m['arguments']:.3f} + "
            f"outputs {m['outputs']:.3f} - donated {m['aliased']:.3f} + temporaries "
            f"{m['temporaries']:.3f}")
    return text + (f"; pinned host {m['host_total']:.3f} GiB" if m["host_total"] else "")


def lower_train_step(cfg: Config, mesh):
    """The train step as the loop runs it (state donated, batch sharded as the data pipeline
    delivers it), lowered for abstract inputs on this mesh: what the loop's first step would
    compile, so the loop runs the executable the check compiled (no second compile). Call it
    outside the mesh context: abstract_train_state sets its own, and train.offload_* need
    optax's eager tx.init to run outside it."""
    spec = resolve(cfg).spec
    tx = make_optimizer(cfg, no_decay=spec.no_decay)
    graphdef, abstract_state, shardings = abstract_train_state(cfg, mesh, tx, spec=spec)
    step = jit_train_step(cfg, mesh, graphdef, shardings, tx, lr_schedule(cfg), spec=spec)
    sharding = NamedSharding(mesh, batch_input_spec())
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
             for k in ("inputs", "targets", "segment_ids", "positions")}
    with model_context(mesh):
        return step.lower(abstract_state, batch)


def compile_train_step(cfg: Config, mesh):
    """cfg's train step compiled for mesh (not run): the executable the loop can run as is
    (its inputs are the state and batch with the shardings lower_train_step gave them)."""
    lowered = lower_train_step(cfg, mesh)  # (builds the abstract state outside the mesh)
    with model_context(mesh):  # execution.loop_double_buffering=false: a per-compile option
        return lowered.compile(compiler_options=xla_flags.compiler_options(cfg) or None)


def step_memory(cfg: Config, mesh) -> dict[str, int]:
    """compiled_memory of cfg's train step compiled for mesh."""
    return compiled_memory(compile_train_step(cfg, mesh))


def device_capacity(cfg: Config, mesh) -> tuple[int, str] | None:
    """(bytes per device the step may use, where that number comes from), or None when there
    is nothing to check against (a CPU without train.device_memory_limit)."""
    limit = cfg.train.device_memory_limit_bytes
    if limit:
        return limit, "train.device_memory_limit"
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    stats = [d.memory_stats() for d in local]
    limits = [s["bytes_limit"] for s in stats if s and s.get("bytes_limit")]
    if not limits:
        return None
    # The allocator's limit (XLA_PYTHON_CLIENT_MEM_FRACTION of the HBM), the smallest device's,
    # agreed by every process: they must all choose the same step or their collectives hang.
    limit = min(limits)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        limit = int(np.min(multihost_utils.process_allgather(np.int64(limit))))
    # JAX's allocator takes 75% of the HBM unless told otherwise: a step that fits the GPU
    # but not that share needs the fraction raised, and the message says so.
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75 by default")
    return limit, (f"the {local[0].device_kind} allocator's limit, "
                   f"XLA_PYTHON_CLIENT_MEM_FRACTION {fraction}")
