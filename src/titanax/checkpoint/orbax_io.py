"""Orbax checkpoints under WORKDIR/checkpoints/<step>/: the train state (sharded arrays, written
by every host as orbax expects), the data iterator position, the config used and the loop's
counters. Saves are asynchronous; each committed step gets a manifest (checkpoint/integrity.py)
so that a damaged newest step is found, reported and skipped for the previous good one. Every
process checksums its share of a step in the background and verifies its share before a
resume; verdicts are agreed through the coordination service's key-value store.

Items of a step (names are stable: generate.py, export and HF import read and write them):
  state   {'step', 'params', 'opt_state'} and, under fp8_delayed, 'fp8' (the amax histories,
          train/state.py), restored onto whatever mesh the abstract state carries (so a run
          can move between mesh shapes and process counts)
  config  the run's Config as JSON
  data    the grain train iterator's state (JSON), optional
  run     loop counters that are not train state (skipped steps), optional
  lora_base  a LoRA run's step whose 'params' are its frozen base (checkpoint/lora_base.py);
          the step's state then holds no 'params' of its own, optional

Parameter layout. Each step's metadata records PARAM_LAYOUT. Layout 2 stores wo as
[L, d, Hq, hd] and w_down as [L, d, F] (embed first, as HF does: FSDP then gathers each layer's
slice along its major axis). Steps without a recorded layout were written before and hold them
as [L, Hq, hd, d] and [L, F, d], the Adam moments alike; restoring such a step (and
checkpoint/reader.py, which export reads through) transposes those leaves into the current
layout, so every checkpoint a user has keeps working. Which leaves and how is the
architecture's to say (ModelSpec.legacy_transposes; Llama's in models/llama3/migrations.py).

State entries moved out of params (MOVED_OUT_OF_PARAMS). fp8_delayed's amax histories were
nnx.Params until issue 19: older steps hold them inside 'params' (params.layers.fp8_wq, ...)
and hold Adam moments for them in 'opt_state'. Restoring such a step into a state with an
'fp8' entry reads them from 'params' and moves them out, and never reads their moments
(a partial restore), so those checkpoints resume as they are.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import os
import pathlib
import re
import shutil
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint import checkpoint_managers as policies

from titanax.checkpoint import integrity
from titanax.checkpoint.lora_base import ITEM as LORA_BASE_ITEM
from titanax.checkpoint.lora_base import BaseRef, KeepBases, MissingBase
from titanax.config import CheckpointConfig, Config, ConfigError, ModelConfig
from titanax.models.registry import model_spec
from titanax.preemption import STOPPING

PARAM_LAYOUT = 2  # the parameter layout this code writes (see the module docstring)
_LAYOUT_KEY = "titanax_param_layout"  # in each step's custom metadata
def legacy_shape(shape, perm) -> tuple:
    """The old-layout shape (or spec) of a current-layout `shape`: the inverse of `perm`."""
    return tuple(shape[i] for i in np.argsort(perm))


def legacy_params(model: ModelConfig, stored_shapes: dict[str, tuple[int, ...]],
                  layout: int | None) -> dict[str, tuple[int, ...]]:
    """{name: perm} of the stacked parameters a checkpoint holds in an old layout (the
    architecture's spec lists them: ModelSpec.legacy_transposes, e.g.
    models/llama3/migrations.py). model: the checkpoint's own config (its dimensions give both
    layouts' shapes); stored_shapes: the stored shape of params.layers.<name>; layout: the
    step's recorded layout, None for steps written before layouts were recorded, which hold
    the old layout. Shapes alone cannot tell: with ffn_dim == d_model both w_down layouts have
    the same shape (and with n_heads == head_dim == d_model both wo layouts)."""
    if layout is not None and layout >= 2:
        return {}
    candidates = model_spec(model).legacy_transposes(model)
    return {name: perm for name, (perm, current) in candidates.items()
            if stored_shapes.get(name) is not None
            and tuple(stored_shapes[name]) == legacy_shape(current, perm)}


def _key_names(keypath) -> tuple[str, ...]:
    keys = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in keypath)
    return tuple(str(k) for k in keys if k != "value")


def _legacy_perm(keypath, legacy: dict) -> tuple[int, ...] | None:
    """The permutation for a train-state leaf of a legacy parameter (the parameter itself or
    an optimizer moment of it: any leaf at ...layers.<name>), else None."""
    names = _key_names(keypath)
    if len(names) >= 2 and names[-2] == "layers" and names[-1] in legacy:
        return legacy[names[-1]]
    return None


def _legacy_abstract(abstract_state, legacy: dict):
    """abstract_state with the legacy leaves in their old shape, sharded by the permuted spec:
    each device restores exactly the data it keeps after the transpose."""
    def old(keypath, leaf):
        perm = _legacy_perm(keypath, legacy)
        if perm is None or len(getattr(leaf, "shape", ())) != len(perm):
            return leaf
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            spec = tuple(sharding.spec) + (None,) * (len(perm) - len(sharding.spec))
            sharding = NamedSharding(sharding.mesh, P(*legacy_shape(spec, perm)),
                                     memory_kind=sharding.memory_kind)
        return jax.ShapeDtypeStruct(legacy_shape(leaf.shape, perm), leaf.dtype,
                                    sharding=sharding)
    return jax.tree_util.tree_map_with_path(old, abstract_state)


def _transposed(x, perm, sharding):
    """x.transpose(perm) on x's devices, placed by `sharding` (a leaf kept in host memory is
    transposed on the device and goes back). No data moves between devices."""
    def f(a):
        if getattr(jax.typeof(a), "memory_space", None) == jax.memory.Space.Host:
            a = jax.device_put(a, jax.memory.Space.Device)
        return jnp.transpose(a, perm)

    out = jax.jit(f, out_shardings=sharding)(x)
    x.delete()  # one old-layout leaf alive beside its transpose at a time
    return out


def _to_current_layout(state, abstract_state, legacy: dict):
    """The restored state with its legacy leaves transposed into the current layout."""
    def convert(keypath, x, target):
        perm = _legacy_perm(keypath, legacy)
        if perm is None or getattr(x, "ndim", None) != len(perm):
            return x
        return _transposed(x, perm, getattr(target, "sharding", None))
    return jax.tree_util.tree_map_with_path(convert, state, abstract_state)


# Train-state entries a LoRA run holds that a step saved without adapters lacks (or holds for
# other parameters: the base's moments): started fresh when LoRA starts from such a step.
LORA_ONLY_ENTRIES = ("lora", "opt_state")

# Train-state entries that older checkpoints kept inside 'params', at the same paths below it
# (with optimizer moments of their own): see the module docstring.
MOVED_OUT_OF_PARAMS = ("fp8",)


def into_params(abstract_state, moved):
    """abstract_state as an older step stores it: the `moved` entries' leaves inside 'params'."""
    out = {k: v for k, v in abstract_state.items() if k not in moved}
    out["params"] = nnx.merge_state(abstract_state["params"], *(abstract_state[k] for k in moved))
    return out


def out_of_params(state, abstract_state, moved):
    """A state restored through into_params(abstract_state, moved) in the current form: the
    `moved` entries' leaves taken out of 'params' (found by the paths abstract_state gives
    them)."""
    state, params = dict(state), state["params"]
    for k in moved:
        paths = {path for path, _ in nnx.to_flat_state(abstract_state[k])}
        state[k], params = nnx.split_state(params, lambda path, _: tuple(path) in paths, ...)
    state["params"] = params
    return state


def partial_restore(directory, item, *, concurrent_gb: float | None = None):
    """The subtree `item` names of the pytree checkpoint at `directory` (a step's 'state'),
    placed as its leaves' shardings say; arrays the item does not name are never read.
    concurrent_gb: cap on the bytes orbax reads at once (default: orbax's)."""
    args = ocp.args.PyTreeRestore(item=item, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(item))
    kw = {} if concurrent_gb is None else {"restore_concurrent_gb": concurrent_gb}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**kw)) as reader:
        return reader.restore(directory, args=args)


class NoGoodCheckpoint(RuntimeError):
    """Every checkpoint of a run is damaged: the run stops rather than start from scratch."""


class DiskFull(RuntimeError):
    """A checkpoint does not fit where it is written (launch.train: one line, exit 1). The
    step's partial folder is removed; the committed steps are untouched."""


def is_disk_full(e: BaseException) -> bool:
    """Does e (or what caused it) say the filesystem is full? orbax reports tensorstore's
    ENOSPC as a ValueError 'RESOURCE_EXHAUSTED: ... Failed writing'."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text or (
                "RESOURCE_EXHAUSTED" in text and "writ" in text):
            return True
        e = e.__cause__ or e.__context__
    return False


class _DiskFullRecords(logging.Filter):
    """Drops orbax's own reports of a full disk: every one of its save threads logs the
    failure with a traceback (hundreds of lines for one save), and the run says it once, as
    DiskFull, when it notices."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not ((exc is not None and is_disk_full(exc))
                    or "RESOURCE_EXHAUSTED" in str(record.msg))


logging.getLogger("absl").addFilter(_DiskFullRecords())


def tree_bytes(tree) -> int:
    """Bytes of every array in tree (global sizes: what a checkpoint of it writes)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree)
               if hasattr(x, "dtype") and hasattr(x, "size"))


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} bytes"


@dataclasses.dataclass
class Restored:
    step: int
    state: dict
    data_state: dict | None
    config: dict
    run_state: dict  # {} for checkpoints that carry none
    # A LoRA run's base (checkpoint/lora_base.py) for its next saves to name: the one this step
    # names, or this step itself when it holds the weights; None without adapters.
    lora_base: BaseRef | None = None


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, cfg: CheckpointConfig, *,
                 read_only: bool = False):
        """read_only: another run's checkpoints (checkpoint.restore): never written, cleaned
        or quarantined."""
        self.directory = pathlib.Path(directory).absolute()
        self.read_only = read_only
        # KeepBases: the frozen base a LoRA run's steps name outlives checkpoint.keep.
        self.bases = KeepBases()
        keep = [policies.LatestN(cfg.keep), self.bases]
        if cfg.permanent_every:
            keep.append(policies.EveryNSteps(cfg.permanent_every))
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=cfg.async_save and not read_only,
            create=not read_only, read_only=read_only,
            # Orbax deletes old steps only after a new one has committed, so the last complete
            # checkpoint survives any failed or interrupted save.
            preservation_policy=policies.AnyPreservationPolicy(keep),
            # Temporary folders of saves cut short by a kill: never a step, only clutter.
            cleanup_tmp_directories=not read_only)
        # Handlers named up front, so reading one item (say the config) needs no guessing.
        handlers = {"state": ocp.StandardCheckpointHandler(),
                    "config": ocp.JsonCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                    "run": ocp.JsonCheckpointHandler(), LORA_BASE_ITEM: ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_handlers=handlers)
        self._sealers: list[threading.Thread] = []  # manifest writers not joined yet
        self._saving: int | None = None  # the step of the last save started
        self._step_bytes = 0  # what a save of the train state writes

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def save(self, step: int, state, *, data_state: dict | None, config: dict,
             run_state: dict | None = None, lora_base: BaseRef | None = None) -> None:
        """Starts an asynchronous save (returns once the arrays are copied off the devices).
        `state` is saved whole, so whatever the train state holds (FP8 scaling history, an RNG
        key) is checkpointed with it; with lora_base (a LoRA run's frozen base, already on
        disk) all of it but 'params', which the step names instead (checkpoint/lora_base.py)."""
        # Like orbax with the previous save, finish the previous manifest first (long done
        # unless checksumming is slower than the save interval): `keep` may now collect that
        # step, and must not while it is being read.
        self._join_sealers()
        items = {"config": ocp.args.JsonSave(config)}
        if lora_base is not None:
            state = {k: v for k, v in state.items() if k != "params"}
            items[LORA_BASE_ITEM] = ocp.args.JsonSave(lora_base.to_json(self.directory))
            if lora_base.directory == self.directory:
                self.bases.steps.add(lora_base.step)
        items["state"] = ocp.args.StandardSave(state)
        if data_state is not None:
            items["data"] = ocp.args.JsonSave(data_state)
        if run_state is not None:
            items["run"] = ocp.args.JsonSave(run_state)
        self._step_bytes = tree_bytes(state)
        # A save that cannot fit is refused before it starts (orbax would fail in its
        # background threads, with a traceback from each); one that fails anyway (another
        # writer filled the disk) is reported the same way when it is noticed.
        free = shutil.disk_usage(self.directory).free
        if free < self._step_bytes:
            self._disk_full(step, free)
        try:
            self.manager.save(step, args=ocp.args.Composite(**items), force=True,
                              custom_metadata={_LAYOUT_KEY: PARAM_LAYOUT})
        except Exception as e:
            if is_disk_full(e):
                self._disk_full(self._saving, shutil.disk_usage(self.directory).free)
            raise
        self._saving = step
        # Checksumming a large checkpoint takes a while: never on the step path, and split
        # over the processes (each its share: integrity.owner).
        sealer = threading.Thread(target=self._seal_when_committed,
                                  args=(step, jax.process_index(), jax.process_count()),
                                  name=f"titanax-manifest-{step}", daemon=True)
        sealer.start()
        self._sealers.append(sealer)

    def _seal_when_committed(self, step: int, index: int, count: int) -> None:
        """Writes this process's part of the step's manifest once orbax is done with the save
        (committed on every process: the folder renamed into place, metadata written); nothing
        if the save failed (no folder). The next save joins this thread before it starts, so no
        other save can begin meanwhile. After a stop signal (STOPPING) it records sizes only
        and returns at once: an exit never waits for a committed step to be read back."""
        while self.manager.is_saving_in_progress():
            time.sleep(0.05)
        if self.step_dir(step).is_dir():
            integrity.seal(self.step_dir(step), index, count, stop=STOPPING)

    def restore(self, step: int, abstract_state):
        """(state placed as abstract_state's shardings say, data iterator state or None, config)."""
        r = self._restore(step, abstract_state)
        return r.state, r.data_state, r.config

    def _restore(self, step: int, abstract_state) -> Restored:
        names = {p.name for p in self.step_dir(step).iterdir() if p.is_dir()}
        if LORA_BASE_ITEM in names:
            return self._restore_on_base(step, abstract_state, names)
        legacy = self.legacy_params(step)
        # A LoRA run's next saves name this step as their base (it holds the weights).
        base = BaseRef(self.directory, step) if "lora" in abstract_state else None
        base_only = self.base_only(step, abstract_state)
        if base_only:
            # A LoRA run starting from a step saved without adapters: its base weights (and
            # step, fp8 histories) only; the caller adds fresh adapters and their optimizer
            # state (train/state.py with_fresh_adapters). The stored moments are never read.
            abstract_state = {k: v for k, v in abstract_state.items()
                              if k not in LORA_ONLY_ENTRIES}
        moved = self.moved_out_of_params(step, abstract_state)
        target = into_params(abstract_state, moved) if moved else abstract_state
        item = _legacy_abstract(target, legacy) if legacy else target
        partial = bool(moved) or base_only
        items = {"config": ocp.args.JsonRestore()}
        if not partial:
            items["state"] = ocp.args.StandardRestore(item)
        for optional in ("data", "run"):
            if optional in names:
                items[optional] = ocp.args.JsonRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        # Moved entries, a base: what the item does not name is left unread.
        state = partial_restore(self.step_dir(step) / "state", item) if partial else out["state"]
        if legacy:
            state = _to_current_layout(state, target, legacy)
        if moved:
            state = out_of_params(state, abstract_state, moved)
        return Restored(step, state, out["data"] if "data" in names else None,
                        out["config"], out["run"] if "run" in names else {}, base)

    def _restore_on_base(self, step: int, abstract_state, names: set[str]) -> Restored:
        """A LoRA step that names its base: its own entries, and 'params' from the base."""
        ref = self.lora_base(step)
        items = {"config": ocp.args.JsonRestore()}
        for optional in ("data", "run"):
            if optional in names:
                items[optional] = ocp.args.JsonRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        own = {k: v for k, v in abstract_state.items() if k != "params"}
        state = partial_restore(self.step_dir(step) / "state", own)
        # The base's weights are this step's: verified against the base's manifest as the
        # step's own files are (restore_latest_good), each process its share.
        where = ref.directory / str(ref.step)
        damage = _agreed(integrity.find_damage(where, jax.process_index(), jax.process_count())
                         if where.is_dir() else None)
        if damage is not None:
            raise RuntimeError(f"its LoRA base {where} is damaged: {damage}")
        state["params"] = self.read_base(ref, {"params": abstract_state["params"]},
                                         by=self.step_dir(step))["params"]
        if ref.directory == self.directory:
            self.bases.steps.add(ref.step)
        return Restored(step, state, out["data"] if "data" in names else None, out["config"],
                        out["run"] if "run" in names else {}, ref)

    def lora_base(self, step: int) -> BaseRef | None:
        """The base a LoRA step names (None: the step holds its weights)."""
        if not (self.step_dir(step) / LORA_BASE_ITEM).is_dir():
            return None
        return BaseRef.from_json(self.manager.restore(step, args=ocp.args.Composite(
            **{LORA_BASE_ITEM: ocp.args.JsonRestore()}))[LORA_BASE_ITEM], self.directory)

    def restore_subtree(self, step: int, target, *, concurrent_gb: float | None = None):
        """The entries `target` names (e.g. {'params': ...}) of the step, in the current
        layout; nothing else is read."""
        legacy = self.legacy_params(step)
        item = _legacy_abstract(target, legacy) if legacy else target
        out = partial_restore(self.step_dir(step) / "state", item, concurrent_gb=concurrent_gb)
        return _to_current_layout(out, target, legacy) if legacy else out

    def read_base(self, ref: BaseRef, target, *, by: pathlib.Path,
                  concurrent_gb: float | None = None):
        """restore_subtree of the base step `ref` (this directory's or another run's, opened
        read-only); MissingBase naming `by` (the step that needs it) when it is gone."""
        if not (ref.directory / str(ref.step) / "state").is_dir():
            raise ref.missing(by)
        if ref.directory == self.directory:
            return self.restore_subtree(ref.step, target, concurrent_gb=concurrent_gb)
        base = Checkpointer(ref.directory, CheckpointConfig(async_save=False), read_only=True)
        try:
            return base.restore_subtree(ref.step, target, concurrent_gb=concurrent_gb)
        finally:
            base.close()

    def base_only(self, step: int, abstract_state) -> bool:
        """Does abstract_state (a LoRA run's: it has 'lora') meet a step saved without
        adapters, from which it takes the base weights alone?"""
        return "lora" in abstract_state and "lora" not in self._state_tree(step)

    def _state_tree(self, step: int) -> dict:
        """The step's stored 'state' tree (orbax metadata: shapes, no arrays read)."""
        meta = ocp.StandardCheckpointHandler().metadata(self.step_dir(step) / "state")
        tree = meta.tree if hasattr(meta, "tree") else meta
        return tree if isinstance(tree, dict) else {}

    def moved_out_of_params(self, step: int, abstract_state) -> tuple[str, ...]:
        """The MOVED_OUT_OF_PARAMS entries abstract_state has and the step does not store
        apart: written before they left 'params' (into_params / out_of_params)."""
        wanted = [k for k in MOVED_OUT_OF_PARAMS if k in abstract_state]
        if not wanted:
            return ()
        stored = self._state_tree(step)
        moved = tuple(k for k in wanted if k not in stored)
        for k in moved:
            for path, _ in nnx.to_flat_state(abstract_state[k]):
                node = stored.get("params")
                for key in path:
                    node = node.get(key) if isinstance(node, dict) else None
                if node is None:
                    raise ValueError(
                        f"checkpoint {self.step_dir(step)} holds no '{k}' state (looked for "
                        f"{k}.{'.'.join(map(str, path))}, and at params.{'.'.join(map(str, path))} "
                        f"where older steps kept it): it was written by a run whose model has "
                        f"none (execution.matmul_precision other than fp8_delayed?); restore it "
                        f"with that run's model settings, or start the new model in a new "
                        f"--workdir")
        return moved

    def param_layout(self, step: int) -> int | None:
        """The parameter layout the step was written with; None: written before layouts
        were recorded (the old layout)."""
        custom = self.manager.metadata(step).custom_metadata or {}
        return custom.get(_LAYOUT_KEY)

    def legacy_params(self, step: int) -> dict[str, tuple[int, ...]]:
        """{name: perm} of the step's stacked parameters stored in the old layout (see
        legacy_params); {} for a step in the current layout."""
        layout = self.param_layout(step)
        if layout is not None and layout >= PARAM_LAYOUT:
            return {}
        model = Config.from_dict(self.read_config(step)).model
        params = self._state_tree(step).get("params")
        layers = params.get("layers") if isinstance(params, dict) else None
        stored = {}
        for name in model_spec(model).legacy_transposes(model):
            leaf = layers.get(name) if isinstance(layers, dict) else None
            leaf = leaf.get("value") if isinstance(leaf, dict) else leaf
            if getattr(leaf, "shape", None) is not None:
                stored[name] = tuple(leaf.shape)
        return legacy_params(model, stored, layout) if stored else {}

    def read_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore()))["config"]

    def restore_latest_good(self, abstract_state, *, cfg: Config | None = None,
                            step: int | None = None, log=print) -> Restored | None:
        """Restores the newest step that is intact (or only `step`); None if there is no step.

        A step is skipped (and reported) when its manifest does not match the files or it fails
        to restore. Skipped steps newer than the restored one are moved aside to
        `<step>.corrupt` in a writable directory, so they are never restored, overwritten or
        counted by `keep` (which would collect good steps in their place); nothing is deleted.
        If no step restores, this raises instead of letting the run start from scratch.
        cfg: refuse (ConfigError) a checkpoint of a different model, naming fields.
        """
        bad: list[tuple[int, str]] = []
        candidates = [step] if step is not None else list(reversed(self.all_steps()))
        for step in candidates:
            # One full read of the step, split: every process reads its share.
            damage = _agreed(integrity.find_damage(self.step_dir(step), jax.process_index(),
                                                   jax.process_count()))
            if damage is None:
                try:
                    config = self.read_config(step)
                except Exception as e:  # noqa: BLE001 - any failure to read means unusable
                    damage = f"its config does not read ({type(e).__name__}: {e})"
                damage = _agreed(damage)
            if damage is None and cfg is not None:
                check_same_model(config, cfg, source=self.step_dir(step))
            if damage is None:
                try:
                    restored = self._restore(step, abstract_state)
                except MissingBase:  # no older step has the base either: not damage
                    raise
                except Exception as e:  # noqa: BLE001
                    damage = f"restoring it failed ({type(e).__name__}: {str(e)[:300]})"
                damage = _agreed(damage)
            if damage is None:
                # Nothing a run trains is non-finite (the step's guard keeps the old weights),
                # so such values are damage: flipped exponent bits, or a step of a run that
                # diverged. Never resume them in place of an older finite step.
                bad_leaf = first_nonfinite(restored.state)
                damage = _agreed(f"it holds non-finite values (in {bad_leaf})"
                                 if bad_leaf else None)
            if damage is None and not self.read_only and \
                    integrity.load_manifest(self.step_dir(step)) is None:
                # Committed, but its run died before the manifest: it restored whole and
                # finite, so it is checksummed now, as it is, and verified like any other
                # step from here on (rather than trusted unchecked for good).
                integrity.seal(self.step_dir(step), jax.process_index(), jax.process_count())
                log(f"checkpoint {self.step_dir(step)} had no manifest (its run stopped between "
                    "the save's commit and the checksums): it restored whole with finite values "
                    "and is checksummed now")
            if damage is not None:
                log(f"checkpoint {self.step_dir(step)} is damaged: {damage}; "
                    f"falling back to the previous one")
                bad.append((step, damage))
                continue
            self._quarantine([s for s, _ in bad], log)
            return restored
        if bad:
            listing = "\n".join(f"  step {s}: {why}" for s, why in bad)
            raise NoGoodCheckpoint(
                f"no checkpoint under {self.directory} restores:\n{listing}\nNothing was moved "
                "or deleted. If they are beyond repair, move them away to start from scratch, "
                "or use --set checkpoint.restore=PATH to start from another run.")
        return None

    def quarantine(self, steps: list[int], log) -> None:
        """Moves the steps aside to `<step>.corrupt` (train/resume_check.py: a step whose
        resume diverged at once); nothing is deleted."""
        self._quarantine(steps, log)

    def _quarantine(self, steps: list[int], log) -> None:
        if not steps or self.read_only:
            return
        if jax.process_index() == 0:
            for step in steps:
                target = self.directory / f"{step}.corrupt"
                n = 1
                while target.exists():
                    n += 1
                    target = self.directory / f"{step}.corrupt{n}"
                self.step_dir(step).rename(target)
                log(f"moved the damaged checkpoint aside to {target}")
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("titanax_checkpoint_quarantine")
        self.manager.reload()

    def wait(self) -> None:
        """Blocks until the last save is committed and this process's part of its manifest
        written (sizes only after a stop signal)."""
        self.manager.wait_until_finished()
        self._join_sealers()

    def _join_sealers(self) -> None:
        for sealer in self._sealers:
            sealer.join()
        self._sealers = []

    def close(self) -> None:
        try:
            self.wait()
        except Exception as e:
            if is_disk_full(e):
                self._disk_full(self._saving, shutil.disk_usage(self.directory).free)
            raise
        self.manager.close()

    def _disk_full(self, step: int | None, free: int) -> None:
        """Removes the step's partial folder (never a step: orbax commits by renaming it) and
        raises DiskFull naming the folder, the bytes a checkpoint needs and those free."""
        if jax.process_index() == 0 and step is not None:
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        try:
            self.manager.reload()
            last = self.manager.latest_step()
        except Exception:  # noqa: BLE001 - the message matters more than the number
            last = None
        newest = (f"the newest complete checkpoint is step {last}" if last is not None else
                  "no checkpoint was completed")
        inodes = "" if os.statvfs(self.directory).f_favail else ", but no free inodes"
        raise DiskFull(
            f"disk full: the checkpoint of step {step} does not fit in {self.directory} "
            f"(a checkpoint of this run needs {_size(self._step_bytes)}, "
            f"{_size(free)} are free there{inodes}); {newest}. Free space (or lower checkpoint.keep) "
            "and run the same command again to resume from it") from None


_AGREEMENTS = itertools.count()  # every process agrees in the same order: same keys
# Peers may verify a large share first; a dead peer is reported sooner, by the heartbeats.
_AGREE_TIMEOUT_MS = 3600_000


def _agreed(damage: str | None) -> str | None:
    """Every process takes the same path: a step one process finds damaged is damaged, and
    process 0 (which logs) says what that process found. Through the coordination service's
    key-value store, not a device collective: nothing is put on the accelerators."""
    count = jax.process_count()
    if count == 1:
        return damage
    from titanax.distributed import coordination_client

    client = coordination_client()
    key = f"titanax/checkpoint_verdict/{next(_AGREEMENTS)}"
    client.key_value_set(f"{key}/{jax.process_index()}", damage or "")  # "": intact
    verdicts = []
    for i in range(count):
        try:
            verdicts.append(client.blocking_key_value_get(f"{key}/{i}", _AGREE_TIMEOUT_MS))
        except Exception as e:  # noqa: BLE001 - jaxlib raises its own error types
            raise RuntimeError(
                f"process {i} did not report its checkpoint check within "
                f"{_AGREE_TIMEOUT_MS // 1000} s ({type(e).__name__}: {e}); see its log") from e
    if damage is None:
        for i, verdict in enumerate(verdicts):
            if verdict:
                return f"{verdict} (found by process {i})"
    return damage


def first_nonfinite(state) -> str | None:
    """The path of the first floating-point leaf of state holding a NaN or an inf, or None.
    Leaves in pinned host memory (train.offload_*) are checked on the device a leaf at a time."""
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.floating):
            continue
        sharding = getattr(x, "sharding", None)
        if getattr(sharding, "memory_kind", None) == "pinned_host":
            x = jax.device_put(x, sharding.with_memory_kind("device"))
        if not bool(_all_finite(x)):
            return jax.tree_util.keystr(path)
    return None


@jax.jit
def _all_finite(x):
    return jnp.all(jnp.isfinite(x))


def check_same_model(saved_config: dict, cfg: Config, *, source) -> None:
    """ConfigError naming every field of the model section that differs between a checkpoint's
    config and cfg: the section is compared whole (its class is the architecture's). The
    execution section may differ (say a GPU attention kernel after a CPU run, or the
    tensor-parallel overlap the planner suggests), except where it changes what the state
    holds: fp8_delayed's amax histories."""
    saved = Config.from_dict(saved_config)
    old, new = saved.model, cfg.model
    names = dict.fromkeys(f.name for m in (old, new) for f in dataclasses.fields(m))
    diffs = [f"model.{n}: {getattr(old, n, None)!r} -> {getattr(new, n, None)!r}"
             for n in names if getattr(old, n, None) != getattr(new, n, None)]
    was, now = saved.execution, cfg.execution
    delayed = (was.matmul_precision, now.matmul_precision).count("fp8_delayed")
    if delayed == 1:
        diffs.append(f"execution.matmul_precision: {was.matmul_precision!r} -> "
                     f"{now.matmul_precision!r} (fp8_delayed keeps amax histories in the state)")
    if delayed == 2 and was.fp8_amax_history != now.fp8_amax_history:
        diffs.append(f"execution.fp8_amax_history: {was.fp8_amax_history!r} -> "
                     f"{now.fp8_amax_history!r} (the length of fp8_delayed's histories)")
    diffs += lora_diffs(saved, cfg)
    if diffs:
        raise ConfigError(
            f"the checkpoint {source} holds a different model than this config asks for "
            f"(checkpoint -> config):\n  " + "\n  ".join(diffs) + "\nSet those fields back to "
            "the checkpoint's values, or train the new model in a new --workdir.")


# The lora fields that change the model (dropout acts in training only).
LORA_MODEL_FIELDS = ("rank", "alpha", "targets")


def lora_diffs(saved: Config, cfg: Config) -> list[str]:
    """The lora fields that differ between a checkpoint's config and cfg, as check_same_model
    lists them. None when the checkpoint holds no adapters and cfg adds them: a LoRA run
    starts from such a base (Checkpointer.base_only)."""
    was, now = saved.lora, cfg.lora
    if not was.enabled:
        return []
    return [f"lora.{n}: {getattr(was, n)!r} -> {getattr(now, n)!r}" + (
            " (a LoRA run's checkpoint holds adapters; merged export is not there yet)"
            if n == "rank" and not now.enabled else "")
            for n in LORA_MODEL_FIELDS if getattr(was, n) != getattr(now, n)]


def resolve_restore_source(path: str | pathlib.Path) -> tuple[pathlib.Path, int | None]:
    """checkpoint.restore=PATH -> (checkpoints folder, step or None for its latest good one).
    PATH may be a run's workdir, its checkpoints/ folder, or one step folder in it."""
    path = pathlib.Path(path).expanduser().absolute()
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", None
    if re.fullmatch(r"\d+", path.name) and (path / "_CHECKPOINT_METADATA").is_file():
        return path.parent, int(path.name)
    if path.is_dir():
        return path, None
    raise ConfigError(f"checkpoint.restore={str(path)!r} does not exist; give a run's workdir, "
                      "its checkpoints/ folder or one step folder in it")
