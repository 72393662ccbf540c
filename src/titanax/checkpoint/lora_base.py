"""A LoRA run's checkpoints name their frozen base instead of copying it (docs/lora.md
"Checkpoints"): a step holds the adapters, their optimizer state, the step counter (and fp8
histories), plus an item 'lora_base' = {"directory": <a run's checkpoints/>, "step": N}, the
step whose 'params' are the base; the run's own folder is written "." (a copied or moved run
still finds its base, and its rotation keeps it), another run's absolutely. Llama-3-70B's base is 141 GB in bf16; its rank-16 adapters
and moments 3.3 GB.

The base step is kept as long as a step of this run names it (KeepBases, one of the
Checkpointer's preservation policies); a base in another run's folder (checkpoint.restore=)
is that run's to keep.
"""

from __future__ import annotations

import dataclasses
import pathlib

ITEM = "lora_base"
# The train-state entry holding a run's adapters (its on-disk name, train/state.py).
ADAPTERS = "lora"

# Train-state entries a LoRA run holds that a step saved without adapters lacks (or holds for
# other parameters: the base's moments): started fresh when LoRA starts from such a step.
LORA_ONLY_ENTRIES = (ADAPTERS, "opt_state")


class MissingBase(FileNotFoundError):
    """The base a LoRA checkpoint names is gone: no older step can stand in for it, so this is
    not a damaged step to fall back from (fallback.restore_latest_good re-raises it)."""


@dataclasses.dataclass(frozen=True)
class BaseRef:
    directory: pathlib.Path  # a run's checkpoints/ folder, absolute (stored relative: to_json)
    step: int

    def to_json(self, here: pathlib.Path | None = None) -> dict:
        """The reference as a step stores it. A base in `here` (the checkpoints folder the
        naming step is saved in: the run's own) is written as ".", so a copied or moved run
        finds (and keeps) its own base step; another run's folder stays absolute."""
        same = here is not None and self.directory.resolve() == pathlib.Path(here).resolve()
        return {"directory": "." if same else str(self.directory), "step": int(self.step)}

    @classmethod
    def from_json(cls, d: dict, here: pathlib.Path | None = None) -> BaseRef:
        """The reference a step in `here` stores: relative to `here`; an absolute one (written
        before references were relative) whose folder no longer holds the step, where `here`
        does, is the run's own base at its old place (the run was moved)."""
        raw, step = pathlib.Path(d["directory"]), int(d["step"])
        if here is None:
            return cls(raw, step)
        here = pathlib.Path(here).absolute()
        if not raw.is_absolute():
            return cls((here / raw).resolve() if str(raw) != "." else here, step)
        if not (raw / str(step)).is_dir() and (here / str(step) / "state").is_dir():
            return cls(here, step)
        return cls(raw, step)

    def missing(self, by: pathlib.Path) -> MissingBase:
        return MissingBase(
            f"checkpoint {by} holds LoRA adapters on the frozen base {self.directory}/{self.step}, "
            "which is gone: restore that step there (or the run it came from), or start the "
            "LoRA run again from a base with --set checkpoint.restore=PATH in a new --workdir")


@dataclasses.dataclass
class KeepBases:
    """orbax preservation policy: keeps the steps of this directory that LoRA steps name as
    their base (filled by Checkpointer.save before each save, and by restore)."""
    steps: set[int] = dataclasses.field(default_factory=set)

    def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
        return [c.step in self.steps for c in checkpoints]


@dataclasses.dataclass
class FrozenBase:
    """Where a run's frozen weights are stored, for its saves to name (train/loop.py): kept is
    the run's role table's say (a LoRA run keeps a frozen base, train/roles.py); ref the base
    its next saves name, None while they must hold the weights themselves."""
    kept: bool
    ref: BaseRef | None = None

    def restored(self, ref: BaseRef | None) -> None:
        """After a restore: the base the restored step named (or is); a run without a frozen
        base saves its weights whatever the step it resumed named."""
        self.ref = ref if self.kept else None

    def saved(self, directory: pathlib.Path, step: int) -> None:
        """After a save: a run begun from its seed has just written its base in this step,
        which the next saves name."""
        if self.kept and self.ref is None:
            self.ref = BaseRef(directory, step)


def without_base_weights(state: dict, base: BaseRef | None, here: pathlib.Path,
                         keep: KeepBases) -> tuple[dict, dict]:
    """(the state a step saves, {ITEM: the reference's JSON} or {}): with a base, the state
    without its weights ('params'), which the step names instead; a base in this run's own
    folder `here` is kept by `keep` from now on."""
    if base is None:
        return state, {}
    if base.directory == here:
        keep.steps.add(base.step)
    return {k: v for k, v in state.items() if k != "params"}, {ITEM: base.to_json(here)}


def base_of_restored(abstract_state: dict, directory: pathlib.Path, step: int) -> BaseRef | None:
    """The base a run's next saves name after restoring `step` (which holds its weights):
    that step, for a run with adapters (its state has ADAPTERS); None otherwise."""
    return BaseRef(directory, step) if ADAPTERS in abstract_state else None


def adapters_start_fresh(abstract_state: dict, stored_state: dict) -> bool:
    """Does a run with adapters meet a step saved without them (its base alone)?"""
    return ADAPTERS in abstract_state and ADAPTERS not in stored_state
