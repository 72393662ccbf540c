"""A Hugging Face folder (sharded index or a single model.safetensors) -> a titanax checkpoint
at step 0 that `launch.train` resumes from (fine-tuning from published weights).

Everything is checked before anything is written: config.json against the titanax config
(model.arch from its model_type, the dimensions from the architecture's hf.py), every file's
header against its size (truncation), and every tensor's name, shape and dtype against the
architecture's tensor table. Then the sharded train state is filled tensor by tensor: each HF
tensor is read from disk, converted to the titanax layout and placed on the devices that own
it, a stacked [L, ...] parameter one layer at a time, so host memory holds one layer.
Only safetensors are read; nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from titanax.config import Config
from titanax.hf.folder import HFImportError, locate, read_config
from titanax.hf.safetensors_io import SafetensorsError, TensorInfo, read_header, read_tensor
from titanax.hf.source import keep_source
from titanax.hf.tokenizer import tokenizer_files, tokenizer_refusal
from titanax.models.common.hf_interop import HFTensor
from titanax.models.registry import spec_for_hf
from titanax.parallel.layer_order import stored_position
from titanax.train.resolved import Resolved, resolve

__all__ = ["HFImportError", "ImportResult", "import_hf", "plan_import"]

FLOAT_DTYPES = ("F32", "BF16", "F16")
_TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# Buffers older transformers versions saved although they are recomputed from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
MAX_REPORTED = 8  # problems listed in one error


@dataclasses.dataclass
class ImportResult:
    workdir: pathlib.Path
    step: int
    tensors: int
    tokenizer: pathlib.Path | None


@dataclasses.dataclass
class _Source:  # where one titanax tensor comes from
    file: pathlib.Path
    info: TensorInfo


def _config_problems(hf_dir: pathlib.Path, hf_cfg: dict, run: Resolved) -> list[str]:
    """config.json against the run's config: the architecture its model_type names, then its
    fields."""
    cfg = run.cfg
    where = hf_dir / "config.json"
    try:
        arch = spec_for_hf(hf_cfg.get("model_type")).arch
    except ValueError as e:
        raise HFImportError(f"{where}: {e}") from None
    if arch != cfg.model.arch:
        return [f"model.arch={cfg.model.arch!r} but config.json's model_type "
                f"{hf_cfg.get('model_type')!r} is {arch!r} (--set model.arch={arch})"]
    try:
        return run.hf.mismatches(hf_cfg, cfg.model)
    except (ValueError, KeyError) as e:
        raise HFImportError(f"{where}: {e if isinstance(e, ValueError) else f'no {e}'}") from None


def _headers(names: dict[str, pathlib.Path], problems: list[str]) -> dict:
    headers = {}
    for f in sorted(set(names.values())):
        try:
            headers[f] = read_header(f)[0]
        except SafetensorsError as e:
            raise HFImportError(str(e)) from None
    for name, f in names.items():
        if name not in headers[f]:
            problems.append(f"tensor {name}: listed in the index for {f.name} but not in that file")
    return headers


def _fail(hf_dir, problems: list[str], what: str = "does not match the config"):
    more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
    raise HFImportError(f"{hf_dir} {what} ({len(problems)} problems):\n  "
                        + "\n  ".join(problems[:MAX_REPORTED]) + more)


def plan_import(hf_dir: str | pathlib.Path, run: Resolved) -> dict[str, _Source]:
    """Checks the HF folder against the run's config (train/resolved.py) and returns where
    each tensor comes from; raises HFImportError naming every problem found (up to
    MAX_REPORTED)."""
    hf_dir, cfg = pathlib.Path(hf_dir), run.cfg
    names = locate(hf_dir)
    hf_cfg = read_config(hf_dir)
    if hf_cfg is not None and (problems := _config_problems(hf_dir, hf_cfg, run)):
        raise HFImportError(f"{hf_dir} does not match the config:\n  " + "\n  ".join(problems))
    declared = hf_cfg and (hf_cfg.get("torch_dtype") or hf_cfg.get("dtype"))
    want_dtype = _TORCH_DTYPES.get(declared) if isinstance(declared, str) else None
    problems = []
    headers = _headers(names, problems)

    interop = run.hf
    table = interop.tensor_table(cfg.model)
    lm_head, embedding = interop.tied_names
    # A tied checkpoint into an untied config: the output layer starts as the embedding.
    tied = bool(hf_cfg and hf_cfg.get("tie_word_embeddings")) and lm_head not in names
    sources = {}
    for t in table:
        src_name = embedding if t.name == lm_head and tied else t.name
        f = names.get(src_name)
        info = headers[f].get(src_name) if f is not None else None
        if info is None:
            problems.append(f"tensor {src_name} is missing (expected shape {list(t.hf_shape)})")
            continue
        if info.shape != t.hf_shape:
            problems.append(f"tensor {src_name}: expected shape {list(t.hf_shape)} from the config, "
                            f"found {list(info.shape)} in {f.name}")
        if info.dtype not in FLOAT_DTYPES or (want_dtype and info.dtype != want_dtype):
            want = want_dtype or " or ".join(FLOAT_DTYPES)
            src = f" (config.json torch_dtype {declared})" if want_dtype else ""
            problems.append(f"tensor {src_name}: expected dtype {want}{src}, found {info.dtype} "
                            f"in {f.name}")
        sources[t.name] = _Source(f, info)
    # A tied config ignores an lm_head the checkpoint carries anyway (a copy of the embedding).
    expected = {t.name for t in table} | ({lm_head} if cfg.model.tie_embeddings else set())
    extra = sorted(n for n in names if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    problems += [f"unexpected tensor {n} in {names[n].name} (not part of a {cfg.model.arch} "
                 "model with this config)" for n in extra]
    if problems:
        _fail(hf_dir, problems)
    return sources


def _load(src: _Source, t: HFTensor, dtype) -> np.ndarray:
    x = np.ascontiguousarray(t.from_hf(read_tensor(src.file, src.info)).astype(dtype))
    # No published weight is NaN or inf, and nothing trains out of one: a file damaged in
    # transit, or a model saved after it diverged. Refused, naming the tensor, before anything
    # is written (one pass over a tensor already in host memory: cheap beside reading it).
    if not np.isfinite(x).all():
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        raise HFImportError(f"{src.file}: tensor {t.name} holds NaN or inf ({bad} of {x.size} "
                            "values): those weights are damaged (a download or copy cut "
                            "short, or a model saved after it diverged); nothing was imported: "
                            "fetch the file again")
    return x


def _put(x: np.ndarray, sharding) -> jax.Array:
    """A host array onto the devices of `sharding`, each device taking only its slice."""
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _space(stacked_sharding):
    # train.offload_params keeps the stack in pinned host memory: the layer goes there first.
    return (jax.memory.Space.Host if getattr(stacked_sharding, "memory_kind", None) == "pinned_host"
            else jax.memory.Space.Device)


def _set_layer(stacked_sharding):
    space = _space(stacked_sharding)
    return jax.jit(lambda stacked, layer, i: jax.lax.dynamic_update_index_in_dim(
        stacked, jax.device_put(layer.astype(stacked.dtype), space), i, 0),
        out_shardings=stacked_sharding, donate_argnums=0)


def _set_expert(stacked_sharding):
    """Writes one expert's [...] into a stacked [L, E, ...] parameter at (layer, expert): the
    hub stores each expert as its own tensor, so host memory holds one expert."""
    space = _space(stacked_sharding)

    def update(stacked, piece, i, e):
        piece = jax.device_put(piece.astype(stacked.dtype)[None, None], space)
        zeros = (jnp.int32(0),) * (stacked.ndim - 2)
        return jax.lax.dynamic_update_slice(stacked, piece, (i, e, *zeros))

    return jax.jit(update, out_shardings=stacked_sharding, donate_argnums=0)


def _param_path(keypath) -> tuple[str, ...]:
    keys = (getattr(k, "key", getattr(k, "name", None)) for k in keypath)
    return tuple(str(k) for k in keys if k != "value")


def _build_params(sources, cfg: Config, mesh, abstract_params, bar, layout):
    """The sharded params tree, each leaf filled from its HF tensors (a stacked one a layer
    at a time, so host memory holds one layer). layout: the state's (train/state.py
    StateLayout: its spec's tensor table, its role table)."""
    position = stored_position(cfg)  # circular-pipeline runs store layers stage-major
    by_param: dict[tuple[str, ...], list[HFTensor]] = {}
    for t in layout.spec.hf.tensor_table(cfg.model):
        by_param.setdefault(t.param, []).append(t)
    tick = (lambda: bar.update(1)) if bar is not None else (lambda: None)

    own = layout.roles.self_updated  # (train/roles.py's role table)

    def build(keypath, target):
        path = _param_path(keypath)
        if path not in by_param and own is not None and own.selects(path):
            # A parameter HF has no tensor for and the step sets (an MoE's routing bias,
            # model.router_bias_update_rate > 0): it starts where a new run's does, at 0.
            return jax.jit(lambda: jnp.zeros(target.shape, target.dtype),
                           out_shardings=target.sharding)()
        tensors = by_param[path]
        if tensors[0].layer is None:
            tick()
            return _put(_load(sources[tensors[0].name], tensors[0], target.dtype),
                        target.sharding)
        spec = target.sharding.spec
        per_expert = tensors[0].expert is not None  # one [L, E, ...] slice per tensor
        lead = 2 if per_expert else 1
        piece_sharding = NamedSharding(mesh, P(*spec[lead:]) if len(spec) else P())
        set_piece = (_set_expert if per_expert else _set_layer)(target.sharding)
        out = jax.jit(lambda: jnp.zeros(target.shape, target.dtype),
                      out_shardings=target.sharding)()
        for t in tensors:
            piece = _put(_load(sources[t.name], t, target.dtype), piece_sharding)
            index = (position[t.layer],) if t.expert is None else (position[t.layer], t.expert)
            out = set_piece(out, piece, *map(jnp.int32, index))
            tick()
        return out

    return jax.tree_util.tree_map_with_path(build, abstract_params)


def _train_state(sources, run: Resolved, devices, progress: bool):
    """Step 0: the imported params and a freshly initialised optimizer state, sharded."""
    from titanax.parallel.mesh import build_mesh
    from titanax.parallel.rules import model_context
    from titanax.train.optim import make_optimizer
    from titanax.train.state import TrainState, fresh_statistics, state_layout

    # The imported weights are a base: a run with lora.rank > 0 adds its adapters (and their
    # optimizer state) when it starts from this step (train/state.py with_fresh_adapters).
    cfg = dataclasses.replace(run.cfg, lora=dataclasses.replace(run.cfg.lora, rank=0))
    mesh = build_mesh(cfg.mesh, devices)
    tx = make_optimizer(cfg, no_decay=run.spec.no_decay)
    layout = state_layout(cfg, mesh, tx, spec=run.spec)
    abstract, shardings = layout.abstract, layout.shardings
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sources), desc="import", unit="tensor", dynamic_ncols=True)
    try:
        with model_context(mesh):
            params = _build_params(sources, cfg, mesh, abstract.trained, bar, layout)
            opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
            state = TrainState(jax.device_put(np.int32(0), shardings.step),
                               {abstract.trained_role: params,
                                **fresh_statistics(abstract)},  # fp8_delayed: zeros
                               opt_state)
    finally:
        if bar is not None:  # ends its line: an error message then starts on its own
            bar.close()
    return state


def finetune_hint(cfg: Config, workdir: pathlib.Path) -> str:
    """The command that fine-tunes the imported run: with the data.source it still needs."""
    from titanax.config import SOURCE_UNSET

    fmt = " --format chat" if cfg.data.format == "examples" else ""
    data = (f" --set data.source=DATA (a folder written by python -m launch.prepare_data{fmt} "
            "with this tokenizer)" if cfg.data.source == SOURCE_UNSET else "")
    return f"fine-tune with python -m launch.train --workdir {workdir}{data}"


def import_hf(hf_dir: str | pathlib.Path, cfg: Config, workdir: str | pathlib.Path, *,
              devices=None, progress: bool = True, log=print,
              origin: tuple[str, str | None] | None = None) -> ImportResult:
    """Writes WORKDIR/checkpoints/0: the HF weights, a freshly initialised optimizer state and
    the config (no data iterator state), also as WORKDIR/config.json, the config
    `launch.train --workdir` trains with when given no --config. The HF tokenizer, if any,
    goes to WORKDIR/hf_tokenizer/ and the saved config's data.tokenizer points at it; the
    source's config.json and generation_config.json go to WORKDIR/hf_source/ (hf/source.py),
    for export to write back, with `origin` ((hub id, commit) the folder came from; default
    its path), the base a LoRA run's PEFT export names."""
    from titanax.train.workdir_lock import workdir_lock

    # The workdir's lock for the whole import (train/workdir_lock.py): an import started
    # beside a live trainer on the same folder is refused (WorkdirLocked, exit 75), and a
    # trainer started during the import waits its turn, instead of the folder ending with one
    # command's config and the other's checkpoints.
    with workdir_lock(workdir, enabled=jax.process_index() == 0):
        return _import_locked(pathlib.Path(hf_dir), cfg, pathlib.Path(workdir), devices,
                              progress, log, origin)


def _import_locked(hf_dir: pathlib.Path, cfg: Config, workdir: pathlib.Path, devices,
                   progress: bool, log, origin) -> ImportResult:
    from titanax.checkpoint.manager import Checkpointer

    ckpt_dir = workdir / "checkpoints"
    if ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
        raise HFImportError(f"{ckpt_dir} already holds checkpoints; import into a new --workdir")
    run = resolve(cfg)  # the import's one lookup of the model's spec
    sources = plan_import(hf_dir, run)
    tok_files = tokenizer_files(hf_dir)
    if (why := tokenizer_refusal(hf_dir)) is not None:
        log(f"warning: {why}")
    state = _train_state(sources, run, devices, progress)

    saved_cfg, tok_dir = cfg, None
    if tok_files:
        tok_dir = workdir / "hf_tokenizer"
        if not cfg.data.tokenizer:
            saved_cfg = dataclasses.replace(cfg, data=dataclasses.replace(
                cfg.data, tokenizer=str((tok_dir / "tokenizer.json").absolute())))
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
    ckpt.save(0, state.to_saved(), data_state=None, config=saved_cfg.to_dict())
    ckpt.close()
    if jax.process_index() == 0:
        if tok_dir is not None:
            tok_dir.mkdir(parents=True, exist_ok=True)
            for f in tok_files:
                shutil.copyfile(f, tok_dir / f.name)
        keep_source(hf_dir, workdir, origin)
        (workdir / "config.json").write_text(json.dumps(saved_cfg.to_dict(), indent=2))
    log(f"imported {len(sources)} tensors from {hf_dir} into {ckpt_dir}/0"
        + (f"; tokenizer in {tok_dir}" if tok_dir else "") + "; " + finetune_hint(saved_cfg, workdir))
    return ImportResult(workdir, 0, len(sources), tok_dir)
