"""Reads single parameters, or a few layers of a stacked [L, ...] parameter, straight out of an
orbax checkpoint, without restoring the train state.

orbax stores each array as a zarr array in an OCDBT key-value store under
WORKDIR/checkpoints/<step>/state, named by its tree path ('params.layers.wq.value'). Opening
that array with tensorstore and indexing it reads only the chunks the index touches, so host
memory holds the requested slice plus the chunks being decoded, never the whole model. orbax
chunks an array by its per-device shard, and splits shards above its target file size (2 GB) into
smaller chunks, so a chunk is at most one device's shard of one parameter.

Checkpoints written before the current parameter layout (migrations.PARAM_LAYOUT: wo stored
[L, Hq, hd, d], w_down [L, F, d]) are read in the current layout: params() reports the current
shapes, read() maps the index onto the stored array and transposes what it read.
"""

from __future__ import annotations

import pathlib

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from titanax.checkpoint import integrity
from titanax.checkpoint.params_only import (
    UnreadableCheckpoint,
    damaged_step,
    open_checkpoints,
    unreadable,
)


class CheckpointReader:
    """Parameters of one step of a run's checkpoints, read on demand."""

    def __init__(self, checkpoint_dir: str | pathlib.Path, step: int | None = None, *,
                 verify: bool = True):
        # Read-only: never creates, cleans or quarantines anything in a run that may still be
        # training; FileNotFoundError (naming the steps present) when there is no such step.
        # verify: the step's files are checked against its manifest first (DamagedCheckpoint);
        # a step without one has every parameter read checked for NaN and inf instead.
        ckpt, step = open_checkpoints(checkpoint_dir, step, verify=verify)
        self.step = step
        self.state_dir = ckpt.step_dir(step) / "state"
        self._unverified = None  # (step folder, older steps) when values must be checked
        if verify and integrity.load_manifest(ckpt.step_dir(step)) is None:
            self._unverified = (ckpt.step_dir(step), [s for s in ckpt.all_steps() if s < step])
        try:
            self.config_dict = ckpt.read_config(step)
            # A LoRA step naming its base (checkpoint/lora_base.py): parameters come from there.
            base = ckpt.lora_base(step)
            # {('layers', name): perm} of parameters stored in the old layout
            self._legacy = {} if base is not None else {
                ("layers", name): perm for name, perm in ckpt.legacy_params(step).items()}
            meta = ocp.StandardCheckpointHandler().metadata(self.state_dir)
        except Exception as e:  # noqa: BLE001 - whatever orbax raised, the step is unusable
            raise unreadable(ckpt, step, "its metadata", e) from e
        finally:
            ckpt.close()
        self._use_zarr3 = bool(meta.use_zarr3)
        self._use_ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(self.state_dir)
        # One context for every array: the OCDBT B-tree cache is shared, not duplicated.
        self._context = ocp.type_handlers.get_ts_context(use_ocdbt=self._use_ocdbt)
        tree = meta.tree if hasattr(meta, "tree") else meta
        self._base = None
        if base is not None:
            if not (base.directory / str(base.step) / "state").is_dir():
                raise base.missing(self.state_dir.parent)
            self._base = CheckpointReader(base.directory, base.step, verify=verify)
        elif "params" not in tree:
            raise ValueError(f"{self.state_dir} holds no 'params' (not a titanax train state)")
        self._arrays = {}  # parameter path -> orbax ArrayMetadata
        _collect(tree.get("params", {}), (), self._arrays)
        # A LoRA run's adapters (saved under 'lora', paths such as ('layers', 'wq_lora_a')): read
        # like parameters, listed apart, so params() stays the model's weights.
        self._adapters = {}
        _collect(tree.get("lora", {}), (), self._adapters)
        self._open: dict[tuple[str, ...], ts.TensorStore] = {}

    def params(self) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
        """{('layers', 'wq'): (shape, dtype), ...} for every stored parameter, in the current
        layout."""
        if self._base is not None:
            return self._base.params()
        out = {}
        for k, m in self._arrays.items():
            shape = tuple(m.shape)
            if k in self._legacy:
                shape = tuple(shape[i] for i in self._legacy[k])
            out[k] = (shape, np.dtype(m.dtype))
        return out

    def adapters(self) -> dict[tuple[str, ...], tuple[tuple[int, ...], np.dtype]]:
        """{('layers', 'wq_lora_a'): (shape, dtype), ...}: a LoRA run's adapters (empty for a
        step saved without them)."""
        return {k: (tuple(m.shape), np.dtype(m.dtype)) for k, m in self._adapters.items()}

    def _store(self, path: tuple[str, ...]) -> ts.TensorStore:
        if path not in self._open:
            m = self._arrays.get(path, self._adapters.get(path))
            if m is None:
                raise KeyError(f"parameter {'.'.join(path)} is not in {self.state_dir} (stored: "
                               f"{sorted('.'.join(p) for p in self._arrays)})")
            info = ocp.type_handlers.ParamInfo(name=m.name, parent_dir=pathlib.Path(m.directory),
                                               use_zarr3=self._use_zarr3, ts_context=self._context)
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=self._use_ocdbt)
            self._open[path] = self._result(ts.open(spec, context=self._context, open=True,
                                                    read=True), path)
        return self._open[path]

    def _result(self, future, path):
        """future.result(), with tensorstore's failure (a damaged or missing file) as
        UnreadableCheckpoint naming the step and parameter."""
        try:
            return future.result()
        except Exception as e:  # noqa: BLE001
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise UnreadableCheckpoint(f"checkpoint {self.state_dir.parent}: reading parameter "
                                       f"{'.'.join(path)} failed ({type(e).__name__}: {first})"
                                       ) from e

    def read(self, path: tuple[str, ...], index=()) -> np.ndarray:
        """The parameter, or `index` of it (e.g. slice(2, 4) for layers 2 and 3), as numpy, in
        the current layout. index: an int, a slice or a tuple of them."""
        if self._base is not None and path not in self._adapters:
            return self._base.read(path, index)
        store = self._store(path)
        perm = self._legacy.get(path)
        if perm is not None:  # stored in the old layout: index it there, then transpose
            index, perm = _legacy_index(index, perm)
        out = np.asarray(self._result((store[index] if index != () else store).read(), path))
        if (self._unverified is not None and _floating(out.dtype)
                and not np.isfinite(out).all()):
            raise damaged_step(*self._unverified, f"it has no manifest and its parameter "
                               f"{'.'.join(path)} holds NaN or inf")
        return out if perm is None else out.transpose(perm)

    def layer_chunk(self, path: tuple[str, ...]) -> int:
        """How many layers one stored chunk of a stacked parameter spans: reading fewer than
        that decodes the same chunk again for the next layers."""
        if self._base is not None and path not in self._adapters:
            return self._base.layer_chunk(path)
        return int(self._store(path).chunk_layout.read_chunk.shape[0])


def _floating(dtype) -> bool:
    """numpy's floats and ml_dtypes' (bfloat16, ...), which numpy does not class as floating."""
    return np.issubdtype(dtype, np.floating) or np.dtype(dtype).name in _ML_FLOATS


_ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def _legacy_index(index, perm):
    """(the index into the old-layout array, the permutation of what it reads) for `index`
    into the current layout, where current = old.transpose(perm)."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > len(perm) or not all(isinstance(i, (int, np.integer, slice)) for i in index):
        raise IndexError(f"reading an old-layout parameter takes ints and slices, one per "
                         f"dimension at most; got {index!r}")
    index = index + (slice(None),) * (len(perm) - len(index))
    old_index = [slice(None)] * len(perm)
    for axis, i in enumerate(index):  # current axis `axis` is old axis perm[axis]
        old_index[perm[axis]] = i
    kept_old = [a for a in range(len(perm)) if isinstance(old_index[a], slice)]
    kept_new = [perm[a] for a in range(len(perm)) if isinstance(index[a], slice)]
    return tuple(old_index), tuple(kept_old.index(a) for a in kept_new)


def _collect(node, prefix, out) -> None:
    if isinstance(node, dict):
        for key, child in node.items():
            # nnx.Param leaves are stored as {'value': array}; the path drops that level.
            _collect(child, prefix if key == "value" else prefix + (key,), out)
    else:
        out[prefix] = node
