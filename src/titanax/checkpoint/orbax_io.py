"""Orbax checkpoints under WORKDIR/checkpoints/<step>/: the train state (sharded arrays, written
by every host as orbax expects), the data iterator position and the config used."""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp

from titanax.config import CheckpointConfig


class Checkpointer:
    def __init__(self, directory: str | pathlib.Path, cfg: CheckpointConfig):
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True)
        # Handlers named up front, so reading one item (say the config) needs no guessing.
        handlers = {"state": ocp.StandardCheckpointHandler(),
                    "config": ocp.JsonCheckpointHandler(), "data": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_handlers=handlers)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, *, data_state: dict | None, config: dict) -> None:
        items = {"state": ocp.args.StandardSave(state), "config": ocp.args.JsonSave(config)}
        if data_state is not None:
            items["data"] = ocp.args.JsonSave(data_state)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, step: int, abstract_state):
        """(state placed as abstract_state's shardings say, data iterator state or None, config)."""
        names = {p.name for p in (self.directory / str(step)).iterdir() if p.is_dir()}
        items = {"state": ocp.args.StandardRestore(abstract_state),
                 "config": ocp.args.JsonRestore()}
        if "data" in names:
            items["data"] = ocp.args.JsonRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        return out["state"], out.get("data") if "data" in names else None, out["config"]

    def read_config(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore()))["config"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
