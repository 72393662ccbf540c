"""A titanax checkpoint -> a Hugging Face folder (config.json, generation_config.json,
safetensors shards with model.safetensors.index.json, tokenizer files), for whichever
architecture the checkpoint's model.arch names (its tensor table and config.json from
models/*/hf.py).

Streaming: tensors are read from the orbax checkpoint a slice at a time (checkpoint/reader.py)
and written into one shard at a time (hf/safetensors_io.py), so host memory holds at
most one block of layers of one parameter (no more than --max-shard-size) plus one converted
tensor, never the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import socket

import ml_dtypes
import numpy as np

from titanax.checkpoint.reader import CheckpointReader
from titanax.config import Config
from titanax.hf.lora_export import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdaptedTensor,
    adapter_base,
    adapter_export,
    check_mode,
    merged_layer,
    peft_factors,
    peft_names,
    write_adapter_config,
)
from titanax.hf.safetensors_io import StreamingWriter, dtype_name
from titanax.hf.source import merge_config, source_config, source_file
from titanax.hf.tokenizer import write_tokenizer
from titanax.parallel.layer_order import stored_position
from titanax.train.resolved import Resolved, resolve

EXPORT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
                 "float16": np.dtype(np.float16)}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (HF's convention: GB = 10^9, GiB = 2^30); plain digits are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional unit "
                         f"(KB, MB, GB, KiB, MiB, GiB), e.g. 5GB")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise ValueError(f"size {text!r} must be > 0")
    return size


@dataclasses.dataclass
class ExportResult:
    out: pathlib.Path
    step: int
    tensors: int
    shards: int
    bytes: int  # tensor data written
    tokenizer: pathlib.Path | None


class _LayerBlocks:
    """Serves one layer of a stacked parameter from the last block of layers read. Blocks are
    as many layers as fit in `budget` bytes, rounded to whole stored chunks when possible, so
    that each chunk is decoded once; export asks for layers in order."""

    def __init__(self, reader: CheckpointReader, budget: int):
        self.reader, self.budget = reader, budget
        self.key, self.block = None, None

    def get(self, path, layer: int, n_layers: int, per_layer_bytes: int) -> np.ndarray:
        if self.key is not None and self.key[0] == path and self.key[1] <= layer < self.key[2]:
            return self.block[layer - self.key[1]]
        fit = max(1, self.budget // max(per_layer_bytes, 1))
        chunk = self.reader.layer_chunk(path)
        size = (fit // chunk) * chunk if fit >= chunk else fit
        start = (layer // size) * size
        stop = min(n_layers, start + size)
        self.block = None  # drop the previous block before reading the next
        self.block = self.reader.read(path, slice(start, stop))
        self.key = (path, start, stop)
        return self.block[layer - start]


def _plan_shards(table, itemsize: int, max_bytes: int) -> list[list]:
    shards, current, size = [], [], 0
    for t in table:
        nbytes = math.prod(t.hf_shape) * itemsize
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += nbytes
    return shards + [current]


def _check_params(reader: CheckpointReader, run: Resolved, table) -> None:
    """Refuses a step whose parameters the table writes are not stored in the shapes the
    model of its config has (the spec's param_shapes: stacked [L, ...], an MoE's experts
    [L, E, ...])."""
    stored, implied = reader.params(), run.spec.param_shapes(run.cfg.model)
    for t in table:
        want = implied.get(t.param)
        got = stored.get(t.param, (None,))[0]
        if got != want:
            raise ValueError(f"checkpoint {reader.state_dir}: parameter {'.'.join(t.param)} has "
                             f"shape {got}, but its config implies {want}")


def _refuse_unmapped(reader: CheckpointReader, run: Resolved, table) -> None:
    """Refuses a checkpoint with self-updated parameters (models/spec.py SelfUpdated: an
    MoE's routing bias, model.router_bias_update_rate > 0) that the HF table has no tensor
    for: they change the model's outputs, so leaving them out must be asked for."""
    own = run.spec.self_updated(run.cfg.model)
    mapped = {t.param for t in table}
    lost = sorted(".".join(p) for p in reader.params() if own is not None
                  and own.selects(p) and p not in mapped)
    if lost:
        raise ValueError(
            f"{reader.state_dir.parent}: parameters {lost} ({own.what}) have no tensor in "
            f"Hugging Face's {run.hf.model_type} format, so the exported model would "
            f"{own.lost_effect} from the trained one; export anyway without them with "
            "--drop-router-bias (drop_unmapped=True)")


def _write_shards(reader: CheckpointReader, cfg: Config, shards, tmp: pathlib.Path,
                  out_dtype, max_shard_bytes: int, bar, adapted: dict | None = None) -> int:
    """Writes every shard and the index into tmp; returns the tensor bytes written. adapted
    (hf/lora_export.py adapted_tensors): the tensors to write with their LoRA adapter merged
    in; None: every tensor as stored."""
    stored = reader.params()
    position = stored_position(cfg)  # circular-pipeline runs store layers stage-major
    blocks = _LayerBlocks(reader, max_shard_bytes)
    adapters = _AdapterStacks(reader)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        plan = [(t.name, t.hf_shape, dtype_name(out_dtype)) for t in shard]
        with StreamingWriter(tmp / name, plan, metadata={"format": "pt"}) as writer:
            for t in shard:
                if t.layer is None:
                    ours = reader.read(t.param)
                else:
                    shape, dtype = stored[t.param]  # a layer is [E, ...] for an expert's tensor
                    ours = blocks.get(t.param, int(position[t.layer]), cfg.model.n_layers,
                                      math.prod(shape[1:]) * dtype.itemsize)
                    if t.expert is not None:
                        ours = ours[t.expert]
                if adapted and t.name in adapted:
                    a, b = adapters.layer(adapted[t.name], int(position[t.layer]))
                    ours = merged_layer(adapted[t.name], ours, a, b, cfg.lora.scale)
                writer.write(t.name, t.to_hf(ours).astype(out_dtype))
                weight_map[t.name] = name
                total += math.prod(t.hf_shape) * out_dtype.itemsize
                if bar is not None:
                    bar.update(1)
    blocks.block = None
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


class _AdapterStacks:
    """One adapted weight's A and B stacks [L, ...], read whole when export moves to that
    weight (the table is weight-major; a 70B rank-16 adapter stack is at most 150 MB)."""

    def __init__(self, reader: CheckpointReader):
        self.reader, self.key, self.ab = reader, None, None

    def layer(self, t: AdaptedTensor, stored_layer: int) -> tuple[np.ndarray, np.ndarray]:
        if self.key != t.a_param:
            self.ab = None
            self.ab = (self.reader.read(t.a_param), self.reader.read(t.b_param))
            self.key = t.a_param
        return self.ab[0][stored_layer], self.ab[1][stored_layer]


def _write_adapter(reader: CheckpointReader, cfg: Config, adapted: dict, tmp: pathlib.Path,
                   out_dtype, base: tuple[str | None, str | None], bar) -> int:
    """adapter_model.safetensors (PEFT's keys and layouts) and adapter_config.json into tmp;
    returns the tensor bytes written."""
    position = stored_position(cfg)
    adapters = _AdapterStacks(reader)
    plan, r = [], cfg.lora.rank
    for name, t in adapted.items():
        key_a, key_b = peft_names(name)
        out_features, in_features = t.tensor.hf_shape
        plan += [(key_a, (r, in_features), dtype_name(out_dtype)),
                 (key_b, (out_features, r), dtype_name(out_dtype))]
    total = 0
    with StreamingWriter(tmp / ADAPTER_WEIGHTS, plan, metadata={"format": "pt"}) as writer:
        for name, t in adapted.items():
            a, b = adapters.layer(t, int(position[t.tensor.layer]))
            for key, value in zip(peft_names(name), peft_factors(t, a, b), strict=True):
                writer.write(key, value.astype(out_dtype))
                total += value.size * out_dtype.itemsize
            if bar is not None:
                bar.update(1)
    write_adapter_config(tmp / ADAPTER_CONFIG, cfg, adapted, base)
    return total


def _write_configs(cfg: Config, workdir: pathlib.Path, tmp: pathlib.Path, dtype: str, hf):
    """Tokenizer files, config.json (the architecture's keys (hf: its HF interop) over an
    imported source's, see hf/source.py) and generation_config.json (an imported one as it
    was); returns the tokenizer's path (None when the run has none)."""
    from titanax.generate import find_tokenizer

    tok_path = find_tokenizer(cfg, workdir)
    bos_id = eos_id = None
    if tok_path is not None:
        bos_id, eos_id = write_tokenizer(tok_path, tmp, cfg.model.max_seq_len)
    ours = hf.to_config(cfg.model, dtype=dtype, bos_id=bos_id, eos_id=eos_id)
    config = merge_config(ours, source_config(workdir), cfg.model.max_seq_len, hf.source_keeps)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    kept = source_file(workdir, "generation_config.json")
    if kept is not None:
        shutil.copyfile(kept, tmp / "generation_config.json")
    else:
        generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return tok_path


def _remove_dead_partials(out: pathlib.Path) -> None:
    """Removes the hidden partial folders of exports to `out` that were killed (kill -9, a
    lost node) on this host: each is the size of the model. Another host's (shared storage)
    may still be writing, so those stay."""
    host = socket.gethostname()
    for partial in out.parent.glob(f".{out.name}.partial-*"):
        tail = partial.name.rsplit(".partial-", 1)[1]
        name, _, pid = tail.rpartition("-")
        if name == host and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(partial, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def export_hf(workdir: str | pathlib.Path, out: str | pathlib.Path, *, step: int | None = None,
              dtype: str = "bfloat16", max_shard_bytes: int = 5 * 10**9,
              progress: bool = True, lora: str = "merged",
              drop_unmapped: bool = False, verify: bool = True,
              base_model_id: str | None = None) -> ExportResult:
    """Writes the run's checkpoint (latest, or `step`) to `out` as an HF folder of its
    architecture (e.g. LlamaForCausalLM). `out` must not exist or be empty;
    the folder appears complete or not at all.

    lora (a LoRA run's; ignored for others): 'merged' writes W + (alpha/r) A B for every
    adapted weight, a plain model; 'adapter' writes a PEFT adapter folder for the base
    (adapter_config.json + adapter_model.safetensors); 'base' writes the frozen base alone.

    drop_unmapped: export a model whose self-updated parameters (an MoE's routing bias) the HF
    architecture has no tensor for; without it such a run is refused, since the HF model
    would route differently from the trained one.

    base_model_id: the hub id an 'adapter' export names as its base (lora_export.py
    adapter_base; default what the import recorded).

    verify: the step's files are checked against its manifest before a tensor is written
    (checkpoint/reader.py; DamagedCheckpoint). An `out` inside a run folder (a workdir) is
    written holding that run's lock (train/workdir_lock.py: WorkdirLocked beside a live run,
    nothing written)."""
    from titanax.train.workdir_lock import enclosing_run, workdir_lock

    run = enclosing_run(out)
    with workdir_lock(run) if run is not None else contextlib.nullcontext():
        return _export(workdir, out, step=step, dtype=dtype, max_shard_bytes=max_shard_bytes,
                       progress=progress, lora=lora, drop_unmapped=drop_unmapped,
                       verify=verify, base_model_id=base_model_id)


def _export(workdir, out, *, step, dtype, max_shard_bytes, progress, lora, drop_unmapped,
            verify, base_model_id=None) -> ExportResult:
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {list(EXPORT_DTYPES)}")
    check_mode(lora)  # hf/lora_export.py's modes
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; choose a new --out")
    workdir = pathlib.Path(workdir)
    reader = CheckpointReader(workdir / "checkpoints", step, verify=verify)
    run = resolve(Config.from_dict(reader.config_dict))  # the export's one lookup of its spec
    cfg = run.cfg
    table = run.hf.tensor_table(cfg.model)  # (ValueError: an architecture without export)
    if not drop_unmapped:
        _refuse_unmapped(reader, run, table)
    adapters = adapter_export(reader, cfg, table, lora)
    _check_params(reader, run, table)
    out_dtype = EXPORT_DTYPES[dtype]
    shards = _plan_shards(table, out_dtype.itemsize, max_shard_bytes)

    _remove_dead_partials(out)
    tmp = out.with_name(f".{out.name}.partial-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    bar = None
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=adapters.tensor_count(table), desc="export", unit="tensor",
                       dynamic_ncols=True)
        if adapters.folder:  # a PEFT adapter folder instead of the model
            total = _write_adapter(reader, cfg, adapters.adapted, tmp, out_dtype,
                                   adapter_base(workdir, base_model_id), bar)
            tensors, n_shards, tok_path = 2 * len(adapters.adapted), 1, None
        else:
            total = _write_shards(reader, cfg, shards, tmp, out_dtype, max_shard_bytes, bar,
                                  adapters.merged)
            tok_path = _write_configs(cfg, workdir, tmp, dtype, run.hf)
            tensors, n_shards = len(table), len(shards)
        if bar is not None:
            bar.close()
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if bar is not None:  # ends its line: an error message then starts on its own
            bar.close()
        raise
    return ExportResult(out, reader.step, tensors, n_shards, total, tok_path)

