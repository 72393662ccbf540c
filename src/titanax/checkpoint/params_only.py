"""The parameters of a run's checkpoint, restored without the rest of the train state.

A step's 'state' item is {'step', 'params', 'opt_state'} (and 'fp8' under fp8_delayed); Adam's
two moments make opt_state twice the size of params, so restoring the whole state to sample (as
a resume does) needs three times the weights' memory. Here orbax restores the 'params' subtree
alone (a partial restore: the item given to orbax holds no opt_state, so no optimizer array is
ever read or allocated), placed on a mesh of the local devices by the training sharding rules
(parallel/rules.py). Under fp8_delayed the amax histories ('fp8') come too: the forward pass
scales its FP8 casts by them, so sampling computes what training and eval computed. A LoRA
run's adapters ('lora') come too: sampling runs the base with its adapters.

Nothing here writes: the checkpoints are opened read-only, and a missing run folder is reported
before orbax is asked anything (orbax would create checkpoints/ in it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import pathlib
import sys

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from titanax.checkpoint import integrity
from titanax.checkpoint.lora_base import MissingBase
from titanax.checkpoint.manager import Checkpointer, partial_restore
from titanax.checkpoint.migrations import into_params
from titanax.checkpoint.migrations import legacy_abstract as _legacy_abstract
from titanax.checkpoint.migrations import to_current_layout as _to_current_layout
from titanax.config import CheckpointConfig, Config, MeshConfig
from titanax.models.common.lora import LoRA
from titanax.models.spec import ModelSpec
from titanax.ops.linear import Fp8Meta
from titanax.parallel.mesh import build_mesh
from titanax.parallel.rules import model_context

# The model's variables a sampler needs, by type, under their train-state entry names (the
# checkpoint's on-disk layout, train/state.py): the weights, fp8_delayed's amax histories, a
# LoRA run's adapters; merged back into one State in this order.
_SAMPLED = (("params", nnx.Param), ("fp8", Fp8Meta), ("lora", LoRA))


class UnreadableCheckpoint(RuntimeError):
    """A step's files are there but do not read back (damaged, truncated, not a titanax run)."""


class DamagedCheckpoint(UnreadableCheckpoint):
    """A step whose files do not match its manifest (checkpoint/integrity.py), or, for a step
    without one, whose parameters hold NaN or inf: its weights are not used (a flipped byte
    in a stored chunk decodes silently, e.g. an output weight of 2.6e23)."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def verify_step(ckpt: Checkpointer, step: int, *, log=_stderr) -> bool:
    """Checks the step's files against its manifest before its weights are used, as a resume
    does (integrity.find_damage, the same check Checkpointer.restore_latest_good runs): every
    byte of the step (parameters, optimizer moments and all) is read once and CRC-32'd.
    Raises DamagedCheckpoint naming the step, the file and the fix. Returns False, with one
    line to `log`, for a step without a manifest (written before manifests existed, or its run
    stopped between the commit and the checksums): as a resume does with such a step, the
    caller then checks the values it reads are finite (a read-only command does not
    checksum it: it writes nothing)."""
    step_dir = ckpt.step_dir(step)
    damage = integrity.find_damage(step_dir)
    if damage is not None:
        raise damaged(ckpt, step, damage)
    if integrity.load_manifest(step_dir) is None:
        log(f"note: checkpoint {step_dir} has no manifest (written before manifests existed, "
            "or its run stopped before the checksums): its files are not verified, only its "
            "values checked to be finite")
        return False
    return True


def damaged(ckpt: Checkpointer, step: int, what: str) -> DamagedCheckpoint:
    """The one-line refusal of a damaged step: what is wrong, and the fix."""
    return damaged_step(ckpt.step_dir(step), [s for s in ckpt.all_steps() if s < step], what)


def damaged_step(step_dir, older: list[int], what: str) -> DamagedCheckpoint:
    hint = (f"use an older step with --step {older[-1]}" if older
            else "no older step to fall back to")
    return DamagedCheckpoint(f"checkpoint {step_dir} is damaged: {what}; {hint}, "
                             "or --no-verify to read it anyway")


@contextlib.contextmanager
def _quiet_orbax():
    """orbax warns on every read-only manager ("Given directory is read only"): true and
    wanted here, and noise in front of a sampling command's output."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def open_checkpoints(directory, step: int | None = None, *, verify: bool = False,
                     log=_stderr) -> tuple[Checkpointer, int]:
    """(read-only Checkpointer, step) for `directory` (a run's checkpoints/ folder) and its
    latest (or the given) step. FileNotFoundError naming the fix when there is none; nothing is
    created either way. verify: verify_step first (DamagedCheckpoint)."""
    directory = pathlib.Path(directory).absolute()
    run = directory.parent
    if not directory.is_dir():
        where = (f"{run} holds no checkpoints/ folder" if run.is_dir()
                 else f"{run} does not exist")
        raise FileNotFoundError(f"no checkpoint under {directory}: {where}; point --workdir at a "
                                f"run folder, or train first with `python -m launch.train "
                                f"--workdir {run}`")
    with _quiet_orbax():
        ckpt = Checkpointer(directory, CheckpointConfig(async_save=False), read_only=True)
    steps = ckpt.all_steps()
    if not steps:
        ckpt.close()
        raise FileNotFoundError(f"no checkpoint under {directory}; train first with "
                                f"`python -m launch.train --workdir {run}`")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        ckpt.close()
        raise FileNotFoundError(f"no checkpoint for step {step} under {directory}; steps "
                                f"present: {steps}")
    if verify:
        try:
            verify_step(ckpt, step, log=log)
        except BaseException:
            ckpt.close()
            raise
    return ckpt, step


def read_run_config(ckpt: Checkpointer, step: int) -> Config:
    """The Config the step was trained with; UnreadableCheckpoint when it does not read."""
    try:
        saved = ckpt.read_config(step)
    except Exception as e:  # noqa: BLE001 - whatever orbax raised, the step is unusable
        raise unreadable(ckpt, step, "its config", e) from e
    return Config.from_dict(saved)


def unreadable(ckpt: Checkpointer, step: int, what: str, e: Exception) -> UnreadableCheckpoint:
    """The error for a step whose `what` failed to read with `e`: one line, naming the root cause
    (orbax wraps tensorstore's error in one that prints the whole read spec) and the previous
    step to try."""
    while e.__cause__ is not None:
        e = e.__cause__
    first = (str(e).strip().splitlines() or [""])[0][:300]
    older = [s for s in ckpt.all_steps() if s < step]
    hint = f"; try an older one with --step {older[-1]}" if older else ""
    return UnreadableCheckpoint(f"checkpoint {ckpt.step_dir(step)}: reading {what} failed "
                                f"({type(e).__name__}: {first}){hint}")


_ORBAX_READS = ("_read_array_index_and_device_put", "async_deserialize")


def _quiet_abandoned_reads() -> None:
    """When one array fails to read, orbax closes its event loop on the reads still running,
    and each of those reports itself later, as a traceback beside our one-line error: as an
    unraisable exception when its coroutine is collected or tensorstore completes it into the
    closed loop ("Event loop is closed"), or through asyncio's logger ("Task exception was
    never retrieved"). Those reports, and only those, are dropped; installed once, before a
    restore, since some arrive before the failure reaches us."""
    if getattr(sys.unraisablehook, "titanax_quiet", False):
        return
    previous = sys.unraisablehook

    def hook(report):
        code = getattr(report.object, "cr_code", None)
        abandoned = getattr(code, "co_name", None) in _ORBAX_READS
        closed = (isinstance(report.exc_value, RuntimeError)
                  and str(report.exc_value) == "Event loop is closed")
        if not (abandoned or closed):
            previous(report)
    hook.titanax_quiet = True
    sys.unraisablehook = hook
    logging.getLogger("asyncio").addFilter(lambda record: not _abandoned_read(record))


def _abandoned_read(record: logging.LogRecord) -> bool:
    """An asyncio report of an orbax array read whose failure nobody awaited: a Task named by
    its coroutine, or the _GatheringFuture that gathered such reads (named only by the
    exception's traceback, through the read functions)."""
    if any(f"{name}()" in record.getMessage() for name in _ORBAX_READS):
        return True
    exc = record.exc_info[1] if record.exc_info else None
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name in _ORBAX_READS:
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


def sampling_mesh(cfg: Config, devices=None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: this process's) for running the model, not training it:
    tensor parallel as far as the heads, kv heads, MLP and vocabulary divide (batch 1 and one
    token per step give data, fsdp's batch and sequence parallelism nothing to split), and
    fsdp over the rest when d_model divides. Devices that fit neither stay unused."""
    devices = list(jax.local_devices() if devices is None else devices)
    m = cfg.model
    split = (m.n_heads, m.n_kv_heads, m.ffn_dim, m.vocab_size)
    n = len(devices)
    tensor = max(t for t in range(1, n + 1) if n % t == 0 and all(s % t == 0 for s in split))
    fsdp = n // tensor if m.d_model % (n // tensor) == 0 else 1
    used = devices[:tensor * fsdp]
    return build_mesh(MeshConfig(data=1, fsdp=fsdp, tensor=tensor, nvlink_domain=len(used)),
                      used)


def abstract_params(cfg: Config, mesh, spec: ModelSpec):
    """(graphdef, params as ShapeDtypeStructs sharded on `mesh`): the model's Params as the train
    state holds them (train/state.py), and under fp8_delayed its amax histories (ops.Fp8Meta,
    the train state's statistics) and with lora.rank > 0 its adapters (LoRA) in the same
    State: nnx.merge(graphdef, params) is the model, adapters included. spec: cfg.model's, as
    the caller resolved it. Allocated nowhere."""
    def init():  # (graphdef, params): a graphdef has no leaves, eval_shape returns it as is
        return nnx.split(
            spec.build(cfg.model, cfg.execution, rngs=nnx.Rngs(params=0), lora=cfg.lora),
            nnx.Any(*(kind for _, kind in _SAMPLED)))

    with model_context(mesh):
        graphdef, abstract = jax.eval_shape(init)
        specs = nnx.get_partition_spec(abstract)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s if isinstance(s, P) else P()),
                             specs, is_leaf=lambda x: isinstance(x, P) or x is None)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            abstract, shardings)
    return graphdef, abstract


def _largest_bytes(tree) -> int:
    return max(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


def restore_params(ckpt: Checkpointer, step: int, abstract, *, verify: bool = False):
    """The step's params (with the fp8 histories, as abstract_params gives them), placed as
    `abstract` says. Only 'params' (and 'fp8') are named in the item orbax restores; with
    partial_restore the step counter and optimizer state are skipped, never read. Old-layout
    checkpoints come back in the current layout, and older fp8_delayed ones (histories inside
    'params') just as well. A LoRA step that names its base (checkpoint/lora_base.py) gives
    its adapters, and the base step's params. verify: the base step's files are checked
    against its manifest too (the step's own are verify_step's, open_checkpoints)."""
    groups = nnx.split_state(abstract, *(kind for _, kind in _SAMPLED))
    # the weights always; the other variables where the model has any
    target = {name: group for (name, _), group in zip(_SAMPLED, groups, strict=True)
              if name == "params" or jax.tree.leaves(group)}
    params = target["params"]
    base = ckpt.lora_base(step)
    if base is not None:
        del target["params"]
        where = base.directory / str(base.step)
        damage = integrity.find_damage(where) if verify and where.is_dir() else None
        if damage is not None:  # every step of the run on that base needs it: none helps
            older = [s for s in ckpt.all_steps() if s < base.step] \
                if base.directory == ckpt.directory else []
            raise damaged_step(ckpt.step_dir(step), older, f"its LoRA base {where}: {damage}")
    moved = ckpt.moved_out_of_params(step, target)
    target = into_params(target, moved) if moved else target  # then: one State already
    legacy = ckpt.legacy_params(step) if base is None else {}
    item = _legacy_abstract(target, legacy) if legacy else target
    # orbax reads every array at once by default: on a GPU host each read waits in host memory
    # for its copy to the device, up to the whole model at once. Capped here at twice the
    # largest parameter (orbax refuses a read larger than the cap, and rounds each read up to
    # whole stored chunks). Not measured on a GPU yet; on the CPU the peak is the same either
    # way (the device is host memory).
    _quiet_abandoned_reads()
    cap = 2 * _largest_bytes(params) / 1e9
    try:
        out = partial_restore(ckpt.step_dir(step) / "state", item, concurrent_gb=cap)
        if base is not None:
            out["params"] = ckpt.read_base(base, {"params": params}, by=ckpt.step_dir(step),
                                           concurrent_gb=cap)["params"]
    except MissingBase:  # the LoRA base step is gone: its own message names it and the fix
        raise
    except Exception as e:  # noqa: BLE001 - whatever orbax raised, the step is unusable
        raise unreadable(ckpt, step, "its parameters", e) from e
    if legacy:
        out = _to_current_layout(out, target, legacy)
    return nnx.merge_state(*(out[name] for name, _ in _SAMPLED if name in out))
