"""The checkpoint manager: orbax checkpoints under WORKDIR/checkpoints/<step>/ saved, restored
and rotated. A step holds the train state (sharded arrays, written by every host as orbax
expects), the data iterator position, the config used and the loop's counters. Saves are
asynchronous; each committed step gets a manifest (checkpoint/integrity.py) so that a damaged
newest step is found, reported and skipped for the previous good one (checkpoint/fallback.py).
Every process checksums its share of a step in the background and verifies its share before a
resume. Older layouts are read into the current one (checkpoint/migrations.py); a save that
does not fit is refused in one line (checkpoint/disk_full.py).

Items of a step (names are stable: generate.py, export and HF import read and write them):
  state   {'step', 'params', 'opt_state'} and, under fp8_delayed, 'fp8' (the amax histories,
          train/state.py), restored onto whatever mesh the abstract state carries (so a run
          can move between mesh shapes and process counts)
  config  the run's Config as JSON
  data    the grain train iterator's state (JSON), optional
  run     loop counters that are not train state (skipped steps), optional
  lora_base  a LoRA run's step whose 'params' are its frozen base (checkpoint/lora_base.py);
          the step's state then holds no 'params' of its own, optional
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil
import threading
import time

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from titanax.checkpoint import fallback, integrity
from titanax.checkpoint.disk_full import disk_full, is_disk_full, remove_partial, tree_bytes
from titanax.checkpoint.fallback import agreed
from titanax.checkpoint.lora_base import ITEM as LORA_BASE_ITEM
from titanax.checkpoint.lora_base import (
    LORA_ONLY_ENTRIES,
    BaseRef,
    KeepBases,
    adapters_start_fresh,
    base_of_restored,
    without_base_weights,
)
from titanax.checkpoint.migrations import (
    LAYOUT_KEY,
    PARAM_LAYOUT,
    into_params,
    legacy_abstract,
    moved_out_of_params,
    out_of_params,
    stored_legacy_params,
    stored_tree,
    to_current_layout,
)
from titanax.config import CheckpointConfig, Config, ConfigError
from titanax.preemption import STOPPING


def partial_restore(directory, item, *, concurrent_gb: float | None = None):
    """The subtree `item` names of the pytree checkpoint at `directory` (a step's 'state'),
    placed as its leaves' shardings say; arrays the item does not name are never read.
    concurrent_gb: cap on the bytes orbax reads at once (default: orbax's)."""
    args = ocp.args.PyTreeRestore(item=item, partial_restore=True,
                                  restore_args=ocp.checkpoint_utils.construct_restore_args(item))
    kw = {} if concurrent_gb is None else {"restore_concurrent_gb": concurrent_gb}
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**kw)) as reader:
        return reader.restore(directory, args=args)


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
        state, named = without_base_weights(state, lora_base, self.directory, self.bases)
        items = {"config": ocp.args.JsonSave(config),
                 **{k: ocp.args.JsonSave(v) for k, v in named.items()}}
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
                              custom_metadata={LAYOUT_KEY: PARAM_LAYOUT})
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
        base = base_of_restored(abstract_state, self.directory, step)
        base_only = self.base_only(step, abstract_state)
        if base_only:
            # A LoRA run starting from a step saved without adapters: its base weights (and
            # step, fp8 histories) only; the caller adds fresh adapters and their optimizer
            # state (train/state.py with_fresh_adapters). The stored moments are never read.
            abstract_state = {k: v for k, v in abstract_state.items()
                              if k not in LORA_ONLY_ENTRIES}
        moved = self.moved_out_of_params(step, abstract_state)
        target = into_params(abstract_state, moved) if moved else abstract_state
        item = legacy_abstract(target, legacy) if legacy else target
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
            state = to_current_layout(state, target, legacy)
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
        damage = agreed(integrity.find_damage(where, jax.process_index(), jax.process_count())
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
        item = legacy_abstract(target, legacy) if legacy else target
        out = partial_restore(self.step_dir(step) / "state", item, concurrent_gb=concurrent_gb)
        return to_current_layout(out, target, legacy) if legacy else out

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
        return adapters_start_fresh(abstract_state, self._state_tree(step))

    def _state_tree(self, step: int) -> dict:
        """The step's stored 'state' tree (orbax metadata: shapes, no arrays read)."""
        return stored_tree(self.step_dir(step) / "state")

    def moved_out_of_params(self, step: int, abstract_state) -> tuple[str, ...]:
        """The entries abstract_state has that the step keeps inside 'params' (migrations.py)."""
        return moved_out_of_params(self.step_dir(step), abstract_state)

    def param_layout(self, step: int) -> int | None:
        """The parameter layout the step was written with; None: written before layouts
        were recorded (the old layout)."""
        custom = self.manager.metadata(step).custom_metadata or {}
        return custom.get(LAYOUT_KEY)

    def legacy_params(self, step: int) -> dict[str, tuple[int, ...]]:
        """{name: perm} of the step's stacked parameters stored in the old layout
        (migrations.legacy_params); {} for a step in the current layout."""
        layout = self.param_layout(step)
        if layout is not None and layout >= PARAM_LAYOUT:
            return {}
        model = Config.from_dict(self.read_config(step)).model
        return stored_legacy_params(model, self._state_tree(step), layout)

    def read_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore()))["config"]

    def restore_latest_good(self, abstract_state, *, cfg: Config | None = None,
                            step: int | None = None, log=print) -> Restored | None:
        """The newest step that is intact (or only `step`) restored, damaged newer ones moved
        aside; None if there is no step (checkpoint/fallback.py). cfg: refuse (ConfigError) a
        checkpoint of a different model, naming fields."""
        return fallback.restore_latest_good(
            self, lambda s: self._restore(s, abstract_state), cfg=cfg, step=step, log=log)

    def quarantine(self, steps: list[int], log) -> None:
        """Moves the steps aside to `<step>.corrupt` (train/resume_check.py: a step whose
        resume diverged at once); nothing is deleted."""
        fallback.quarantine(self, steps, log)

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
        """Removes the step's partial folder and raises DiskFull naming the folder, the bytes
        a checkpoint needs and those free (checkpoint/disk_full.py)."""
        remove_partial(self.directory, step)
        try:
            self.manager.reload()
            last = self.manager.latest_step()
        except Exception:  # noqa: BLE001 - the message matters more than the number
            last = None
        raise disk_full(self.directory, step, self._step_bytes, free, last) from None


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
