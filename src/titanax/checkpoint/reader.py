"""Reads single parameters, or a few layers of a stacked [L, ...] parameter, straight out of an
orbax checkpoint, without restoring the train state.

orbax stores each array as a zarr array in an OCDBT key-value store under
WORKDIR/checkpoints/<step>/state, named by its tree path ('params.layers.wq.value'). Opening
that array with tensorstore and indexing it reads only the chunks the index touches, so host
memory holds the requested slice plus the chunks being decoded, never the whole model. orbax
chunks an array by its per-device shard, and splits shards above its target file size (2 GB) into
smaller chunks, so a chunk is at most one device's shard of one parameter.
"""

from __future__ import annotations

import pathlib

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from titanax.checkpoint.orbax_io import Checkpointer
from titanax.config import CheckpointConfig


class CheckpointReader:
    """Parameters of one step of a run's checkpoints, read on demand."""

    def __init__(self, checkpoint_dir: str | pathlib.Path, step: int | None = None):
        # read_only: never cleans or quarantines anything in a run that may still be training.
        ckpt = Checkpointer(checkpoint_dir, CheckpointConfig(async_save=False), read_only=True)
        steps = ckpt.all_steps()
        if not steps:
            ckpt.close()
            raise FileNotFoundError(f"no checkpoint under {ckpt.directory}; train first, or point "
                                    "--workdir at a run folder")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            ckpt.close()
            raise FileNotFoundError(f"no checkpoint for step {step} under {ckpt.directory}; "
                                    f"steps present: {steps}")
        self.step = step
        self.config_dict = ckpt.read_config(step)
        ckpt.close()
        self.state_dir = pathlib.Path(checkpoint_dir).absolute() / str(step) / "state"
        meta = ocp.StandardCheckpointHandler().metadata(self.state_dir)
        self._use_zarr3 = bool(meta.use_zarr3)
        self._use_ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(self.state_dir)
        # One context for every array: the OCDBT B-tree cache is shared, not duplicated.
        self._context = ocp.type_handlers.get_ts_context(use_ocdbt=self._use_ocdbt)
        tree = meta.tree if hasattr(meta, "tree") else meta
        if "params" not in tree:
            raise ValueError(f"{self.state_dir} holds no 'params' (not a titanax train state)")
        self._arrays = {}  # parameter path -> orbax ArrayMetadata
        _collect(tree["params"], (), self._arrays)
        self._open: dict[tuple[str, ...], ts.TensorStore] = {}

    def params(self) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
        """{('layers', 'wq'): (shape, dtype), ...} for every stored parameter."""
        return {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in self._arrays.items()}

    def _store(self, path: tuple[str, ...]) -> ts.TensorStore:
        if path not in self._open:
            if path not in self._arrays:
                raise KeyError(f"parameter {'.'.join(path)} is not in {self.state_dir} (stored: "
                               f"{sorted('.'.join(p) for p in self._arrays)})")
            m = self._arrays[path]
            info = ocp.type_handlers.ParamInfo(name=m.name, parent_dir=pathlib.Path(m.directory),
                                               use_zarr3=self._use_zarr3, ts_context=self._context)
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._use_ocdbt)
            self._open[path] = ts.open(spec, context=self._context, open=True, read=True).result()
        return self._open[path]

    def read(self, path: tuple[str, ...], index=()) -> np.ndarray:
        """The parameter, or `index` of it (e.g. slice(2, 4) for layers 2 and 3), as numpy."""
        store = self._store(path)
        return np.asarray(store[index].read().result() if index != () else store.read().result())

    def layer_chunk(self, path: tuple[str, ...]) -> int:
        """How many layers one stored chunk of a stacked parameter spans: reading fewer than
        that decodes the same chunk again for the next layers."""
        return int(self._store(path).chunk_layout.read_chunk.shape[0])


def _collect(node, prefix, out) -> None:
    if isinstance(node, dict):
        for key, child in node.items():
            # nnx.Param leaves are stored as {'value': array}; the path drops that level.
            _collect(child, prefix if key == "value" else prefix + (key,), out)
    else:
        out[prefix] = node
