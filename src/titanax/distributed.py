"""Multi-process start-up: who the coordinator is, how many processes, which one we are.

A run is multi-process when any of these says so, first match wins:
  1. explicit arguments (launch.train --coordinator HOST:PORT --num-processes N --process-id I),
  2. TITANAX_COORDINATOR / TITANAX_NUM_PROCESSES / TITANAX_PROCESS_ID,
  3. jax's own JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID,
  4. a SLURM job step (`srun`) with more than one task.
Otherwise it is one process and jax.distributed is never started.

SLURM: jax's own detection assumes one task per GPU and pins each task to GPU SLURM_LOCALID.
titanax also supports one task per node (fewer processes, one coordination client per node,
all the node's GPUs visible to it), so it resolves the SLURM step itself: one task on a node
sees every local device, several tasks on a node see one device each. JAX_LOCAL_DEVICE_IDS
overrides either choice.

Failure detection: every process heartbeats to the coordination service. When a process dies
(crash, OOM kill, lost node) the service tells the others, which abort instead of waiting in
a collective forever; `heartbeat_timeout_s` bounds how long that takes. XLA aborts with a C++
stack trace and no hook for Python, so titanax.process_guard runs the training in a child
process and turns that abort into one line naming the lost process.
"""

from __future__ import annotations

import dataclasses
import os
import re


class DistributedError(RuntimeError):
    """The multi-process settings are incomplete or contradictory; the message says the fix."""


@dataclasses.dataclass(frozen=True)
class ProcessSpec:
    coordinator: str  # HOST:PORT of process 0's coordination service
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None  # None: every device of this host
    source: str  # where the settings came from, for the start-up log

    def __post_init__(self):
        if self.num_processes < 1:
            raise DistributedError(f"num_processes must be >= 1, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise DistributedError(
                f"process id {self.process_id} is outside [0, {self.num_processes}); give each "
                f"process a distinct id from 0 to {self.num_processes - 1}")
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit():
            raise DistributedError(f"coordinator {self.coordinator!r} is not HOST:PORT (e.g. "
                                   "node001:12345, the host of process 0 and a free port)")

    def describe(self) -> str:
        devices = ("all local devices" if self.local_device_ids is None
                   else f"local devices {list(self.local_device_ids)}")
        return (f"process {self.process_id}/{self.num_processes}, coordinator "
                f"{self.coordinator}, {devices} (from {self.source})")


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"{name}={value!r} is not an integer") from None


def _from_triple(coordinator, num_processes, process_id, names: tuple[str, str, str],
                 source: str, local_ids) -> ProcessSpec | None:
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given):
        return None
    if not all(given):
        missing = [n for n, g in zip(names, given) if not g]
        raise DistributedError(
            f"multi-process start-up needs all of {', '.join(names)}; {', '.join(missing)} "
            f"missing (from {source})")
    return ProcessSpec(str(coordinator), _int(str(num_processes), names[1]),
                       _int(str(process_id), names[2]), local_ids, source)


def _local_ids_from_env(env) -> tuple[int, ...] | None:
    raw = env.get("JAX_LOCAL_DEVICE_IDS")
    if not raw:
        return None
    return tuple(_int(x, "JAX_LOCAL_DEVICE_IDS") for x in raw.split(","))


def first_host(nodelist: str) -> str:
    """The first host of a SLURM nodelist: 'n1' of 'n1,n2', 'node001' of 'node[001-016],x'."""
    m = re.match(r"([^,\[]*)(?:\[([^,\-\]]*))?", nodelist)
    return m.group(1) + (m.group(2) or "")


def _slurm(env, local_ids) -> ProcessSpec | None:
    if "SLURM_JOB_ID" not in env:
        return None
    if "SLURM_STEP_NODELIST" not in env or "SLURM_PROCID" not in env:
        nodes = _int(env.get("SLURM_JOB_NUM_NODES", "1"), "SLURM_JOB_NUM_NODES")
        if nodes > 1:
            raise DistributedError(
                f"this SLURM job has {nodes} nodes but the program was not started by srun "
                "(no SLURM_STEP_NODELIST/SLURM_PROCID): start one task per node with "
                "`srun python -m launch.train ...` (see launch/slurm/train.sbatch)")
        return None
    ntasks = _int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")), "SLURM_NTASKS")
    if ntasks == 1:
        return None
    # Port: TITANAX_COORDINATOR_PORT, JAX_COORDINATOR_PORT, else derived from the job id as
    # jax's SLURM support does (so both agree), in the ephemeral range.
    port = (env.get("TITANAX_COORDINATOR_PORT") or env.get("JAX_COORDINATOR_PORT")
            or str(_int(env["SLURM_JOB_ID"], "SLURM_JOB_ID") % 2**12 + 65535 - 2**12 + 1))
    coordinator = f"{first_host(env['SLURM_STEP_NODELIST'])}:{port}"
    nodes = _int(env.get("SLURM_STEP_NUM_NODES", env.get("SLURM_NNODES", "1")), "SLURM_NNODES")
    if local_ids is None and ntasks > nodes:  # several tasks per node: one GPU each
        local_ids = (_int(env.get("SLURM_LOCALID", "0"), "SLURM_LOCALID"),)
    return ProcessSpec(coordinator, ntasks, _int(env["SLURM_PROCID"], "SLURM_PROCID"),
                       local_ids, f"SLURM job {env['SLURM_JOB_ID']}, {nodes} node(s)")


def resolve_processes(coordinator: str | None = None, num_processes: int | None = None,
                      process_id: int | None = None, env=None) -> ProcessSpec | None:
    """The multi-process settings of this run, or None for a single-process run."""
    env = os.environ if env is None else env
    local_ids = _local_ids_from_env(env)
    spec = (
        _from_triple(coordinator, num_processes, process_id,
                     ("--coordinator", "--num-processes", "--process-id"), "flags", local_ids)
        or _from_triple(env.get("TITANAX_COORDINATOR"), env.get("TITANAX_NUM_PROCESSES"),
                        env.get("TITANAX_PROCESS_ID"), ("TITANAX_COORDINATOR",
                        "TITANAX_NUM_PROCESSES", "TITANAX_PROCESS_ID"), "TITANAX_* env",
                        local_ids)
        or _from_triple(env.get("JAX_COORDINATOR_ADDRESS"), env.get("JAX_NUM_PROCESSES"),
                        env.get("JAX_PROCESS_ID"), ("JAX_COORDINATOR_ADDRESS",
                        "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"), "JAX_* env", local_ids)
        or _slurm(env, local_ids))
    if spec is not None and spec.num_processes == 1:
        return None
    return spec


def initialize(spec: ProcessSpec, *, heartbeat_timeout_s: int = 60,
               init_timeout_s: int = 300) -> None:
    """jax.distributed.initialize for `spec`. Must run before anything touches a jax backend.
    Blocks until all processes have connected (at most init_timeout_s, then raises)."""
    import jax

    jax.distributed.initialize(
        coordinator_address=spec.coordinator, num_processes=spec.num_processes,
        process_id=spec.process_id,
        local_device_ids=list(spec.local_device_ids) if spec.local_device_ids else None,
        # Everything is resolved above; jax's detection would pin one GPU per SLURM task.
        cluster_detection_method="deactivate",
        initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=heartbeat_timeout_s)


def coordination_client():
    """The coordination service's key-value client of a multi-process run (started by
    initialize), else None: how processes agree on host-side facts (a stop signal, a checkpoint
    verdict) without a device collective. jax exposes it only as jax._src state."""
    import jax

    if jax.process_count() == 1:
        return None
    from jax._src.distributed import global_state

    if global_state.client is None:
        raise RuntimeError("jax.process_count() > 1 but jax.distributed is not initialized; "
                           "start multi-process runs through titanax.distributed.initialize")
    return global_state.client
