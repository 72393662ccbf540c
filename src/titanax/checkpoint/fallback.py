"""The step a run resumes from: the newest one that is intact. A step is damaged when its
manifest (checkpoint/integrity.py) does not match its files, its config does not read, it fails
to restore or it holds non-finite values; every process checks its share and the verdicts are
agreed through the coordination service's key-value store, so all take the same path. Damaged
steps are reported, skipped for the previous good one, and moved aside (quarantined) to
`<step>.corrupt`; nothing is deleted, and a run none of whose steps restores stops
(NoGoodCheckpoint) rather than start from scratch.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils

from titanax.checkpoint import integrity
from titanax.checkpoint.compare import check_same_model
from titanax.checkpoint.lora_base import MissingBase
from titanax.config import Config


class NoGoodCheckpoint(RuntimeError):
    """Every checkpoint of a run is damaged: the run stops rather than start from scratch."""


def restore_latest_good(ckpt, restore, *, cfg: Config | None = None,
                        step: int | None = None, log=print):
    """Restores the newest step of the Checkpointer `ckpt` that is intact (or only `step`) by
    restore(step) -> a manager.Restored; None if there is no step.

    A step is skipped (and reported) when its manifest does not match the files or it fails
    to restore. Skipped steps newer than the restored one are moved aside to
    `<step>.corrupt` in a writable directory, so they are never restored, overwritten or
    counted by `keep` (which would collect good steps in their place); nothing is deleted.
    If no step restores, this raises instead of letting the run start from scratch.
    cfg: refuse (ConfigError) a checkpoint of a different model, naming fields.
    """
    bad: list[tuple[int, str]] = []
    candidates = [step] if step is not None else list(reversed(ckpt.all_steps()))
    for step in candidates:
        # One full read of the step, split: every process reads its share.
        damage = agreed(integrity.find_damage(ckpt.step_dir(step), jax.process_index(),
                                              jax.process_count()))
        if damage is None:
            try:
                config = ckpt.read_config(step)
            except Exception as e:  # noqa: BLE001 - any failure to read means unusable
                damage = f"its config does not read ({type(e).__name__}: {e})"
            damage = agreed(damage)
        if damage is None and cfg is not None:
            check_same_model(config, cfg, source=ckpt.step_dir(step))
        if damage is None:
            try:
                restored = restore(step)
            except MissingBase:  # no older step has the base either: not damage
                raise
            except Exception as e:  # noqa: BLE001
                damage = f"restoring it failed ({type(e).__name__}: {str(e)[:300]})"
            damage = agreed(damage)
        if damage is None:
            # Nothing a run trains is non-finite (the step's guard keeps the old weights),
            # so such values are damage: flipped exponent bits, or a step of a run that
            # diverged. Never resume them in place of an older finite step.
            bad_leaf = first_nonfinite(restored.state)
            damage = agreed(f"it holds non-finite values (in {bad_leaf})"
                            if bad_leaf else None)
        if damage is None and not ckpt.read_only and \
                integrity.load_manifest(ckpt.step_dir(step)) is None:
            # Committed, but its run died before the manifest: it restored whole and
            # finite, so it is checksummed now, as it is, and verified like any other
            # step from here on (rather than trusted unchecked for good).
            integrity.seal(ckpt.step_dir(step), jax.process_index(), jax.process_count())
            log(f"checkpoint {ckpt.step_dir(step)} had no manifest (its run stopped between "
                "the save's commit and the checksums): it restored whole with finite values "
                "and is checksummed now")
        if damage is not None:
            log(f"checkpoint {ckpt.step_dir(step)} is damaged: {damage}; "
                f"falling back to the previous one")
            bad.append((step, damage))
            continue
        quarantine(ckpt, [s for s, _ in bad], log)
        return restored
    if bad:
        listing = "\n".join(f"  step {s}: {why}" for s, why in bad)
        raise NoGoodCheckpoint(
            f"no checkpoint under {ckpt.directory} restores:\n{listing}\nNothing was moved "
            "or deleted. If they are beyond repair, move them away to start from scratch, "
            "or use --set checkpoint.restore=PATH to start from another run.")
    return None


def quarantine(ckpt, steps: list[int], log) -> None:
    """Moves the steps of the Checkpointer `ckpt` aside to `<step>.corrupt` (`.corrupt2`, ...
    where that exists); nothing is deleted, nothing moved in a read-only one."""
    if not steps or ckpt.read_only:
        return
    if jax.process_index() == 0:
        for step in steps:
            target = ckpt.directory / f"{step}.corrupt"
            n = 1
            while target.exists():
                n += 1
                target = ckpt.directory / f"{step}.corrupt{n}"
            ckpt.step_dir(step).rename(target)
            log(f"moved the damaged checkpoint aside to {target}")
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("titanax_checkpoint_quarantine")
    ckpt.manager.reload()


_AGREEMENTS = itertools.count()  # every process agrees in the same order: same keys
# Peers may verify a large share first; a dead peer is reported sooner, by the heartbeats.
_AGREE_TIMEOUT_MS = 3600_000


def agreed(damage: str | None) -> str | None:
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
