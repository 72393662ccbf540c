"""A Hugging Face Llama folder (sharded index or a single model.safetensors) -> a titanax
checkpoint at step 0 that `launch.train` resumes from (fine-tuning from published weights).

Everything is checked before anything is written: config.json against the titanax config, every
file's header against its size (truncation), and every tensor's name, shape and dtype against
the tensor table (checkpoint/hf.py). Then the sharded train state is filled tensor by tensor:
each HF tensor is read from disk, converted to the titanax layout and placed on the devices
that own it, a stacked [L, ...] parameter one layer at a time, so host memory holds one layer.
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
from jax.sharding import NamedSharding, PartitionSpec as P

from titanax.checkpoint import hf
from titanax.checkpoint.safetensors_io import SafetensorsError, TensorInfo, read_header, read_tensor
from titanax.config import Config
from titanax.parallel.layer_order import stored_position

FLOAT_DTYPES = ("F32", "BF16", "F16")
_TORCH_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# Buffers older transformers versions saved although they are recomputed from the config.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_REPORTED = 8  # problems listed in one error


class HFImportError(ValueError):
    """The HF folder does not match the config (or is damaged); nothing was written."""


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


def _locate(hf_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    """{tensor name: file} from model.safetensors.index.json or model.safetensors."""
    if not hf_dir.is_dir():
        raise HFImportError(f"--hf {hf_dir}: not a folder (give a local Hugging Face model folder)")
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFImportError(f"{index}: not a safetensors index ({e!r})") from None
        files = {hf_dir / f for f in set(weight_map.values())}
        missing = sorted(str(f) for f in files if not f.is_file())
        if missing:
            raise HFImportError(f"{index} lists shard files that do not exist: {missing}")
        return {name: hf_dir / f for name, f in weight_map.items()}
    single = hf_dir / "model.safetensors"
    if single.is_file():
        try:
            return {name: single for name in read_header(single)[0]}
        except SafetensorsError as e:
            raise HFImportError(str(e)) from None
    pickled = sorted(p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pth", ".pt"))
    hint = (f"; it has {pickled[:3]}, pickled weights, which titanax never loads: convert them "
            "to safetensors first (e.g. save_pretrained(..., safe_serialization=True) in a "
            "sandbox you trust)") if pickled else ""
    raise HFImportError(f"{hf_dir}: no model.safetensors.index.json or model.safetensors{hint}")


def _hf_config(hf_dir: pathlib.Path) -> dict | None:
    path = hf_dir / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFImportError(f"{path}: not valid JSON ({e})") from None


def plan_import(hf_dir: str | pathlib.Path, cfg: Config) -> dict[str, _Source]:
    """Checks the HF folder against cfg and returns where each tensor comes from; raises
    HFImportError naming every problem found (up to MAX_REPORTED)."""
    hf_dir = pathlib.Path(hf_dir)
    names = _locate(hf_dir)
    hf_cfg = _hf_config(hf_dir)
    problems = []
    if hf_cfg is not None:
        try:
            problems += hf.config_mismatches(hf_cfg, cfg.model)
        except (ValueError, KeyError) as e:
            raise HFImportError(f"{hf_dir / 'config.json'}: {e if isinstance(e, ValueError) else f'no {e}'}") from None
        if problems:
            raise HFImportError(f"{hf_dir} does not match the config:\n  " + "\n  ".join(problems))
    declared = hf_cfg and (hf_cfg.get("torch_dtype") or hf_cfg.get("dtype"))
    want_dtype = _TORCH_DTYPES.get(declared) if isinstance(declared, str) else None

    headers = {}
    for f in sorted(set(names.values())):
        try:
            headers[f] = read_header(f)[0]
        except SafetensorsError as e:
            raise HFImportError(str(e)) from None
    for name, f in names.items():
        if name not in headers[f]:
            problems.append(f"tensor {name}: listed in the index for {f.name} but not in that file")

    table = hf.tensor_table(cfg.model)
    expected = {t.name for t in table}
    tied = bool(hf_cfg and hf_cfg.get("tie_word_embeddings")) and "lm_head.weight" not in names
    sources = {}
    for t in table:
        src_name = t.name
        if t.name == "lm_head.weight" and tied:  # tied: lm_head is embed_tokens, same [V, d]
            src_name = "model.embed_tokens.weight"
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
    extra = sorted(n for n in names if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    problems += [f"unexpected tensor {n} in {names[n].name} (not part of a Llama with this "
                 "config)" for n in extra]
    if problems:
        more = f"\n  ... and {len(problems) - MAX_REPORTED} more" if len(problems) > MAX_REPORTED else ""
        raise HFImportError(f"{hf_dir} does not match the config ({len(problems)} problems):\n  "
                            + "\n  ".join(problems[:MAX_REPORTED]) + more)
    return sources


def _load(src: _Source, t: hf.HFTensor, dtype) -> np.ndarray:
    return np.ascontiguousarray(t.from_hf(read_tensor(src.file, src.info)).astype(dtype))


def _put(x: np.ndarray, sharding) -> jax.Array:
    """A host array onto the devices of `sharding`, each device taking only its slice."""
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def _set_layer(stacked_sharding):
    # train.offload_params keeps the stack in pinned host memory: the layer goes there first.
    space = (jax.memory.Space.Host if getattr(stacked_sharding, "memory_kind", None) == "pinned_host"
             else jax.memory.Space.Device)
    return jax.jit(lambda stacked, layer, i: jax.lax.dynamic_update_index_in_dim(
        stacked, jax.device_put(layer.astype(stacked.dtype), space), i, 0),
        out_shardings=stacked_sharding, donate_argnums=0)


def _param_path(keypath) -> tuple[str, ...]:
    keys = (getattr(k, "key", getattr(k, "name", None)) for k in keypath)
    return tuple(str(k) for k in keys if k != "value")


def _tokenizer_files(hf_dir: pathlib.Path) -> list[pathlib.Path]:
    """The folder's tokenizer files, if titanax's Tokenizer can use them (else none)."""
    from titanax.config import ConfigError
    from titanax.data.tokenizer import Tokenizer

    if not (hf_dir / "tokenizer.json").is_file():
        return []
    try:
        Tokenizer.load(hf_dir / "tokenizer.json")
    except ConfigError:
        return []
    return [hf_dir / n for n in TOKENIZER_FILES if (hf_dir / n).is_file()]


def import_hf(hf_dir: str | pathlib.Path, cfg: Config, workdir: str | pathlib.Path, *,
              devices=None, progress: bool = True, log=print) -> ImportResult:
    """Writes WORKDIR/checkpoints/0: the HF weights, a freshly initialised optimizer state and
    the config (no data iterator state). The HF tokenizer, if any, goes to
    WORKDIR/hf_tokenizer/ and the saved config's data.tokenizer points at it."""
    from titanax.checkpoint.orbax_io import Checkpointer
    from titanax.parallel.mesh import build_mesh
    from titanax.parallel.rules import model_context
    from titanax.train.optim import make_optimizer
    from titanax.train.state import abstract_train_state

    hf_dir, workdir = pathlib.Path(hf_dir), pathlib.Path(workdir)
    ckpt_dir = workdir / "checkpoints"
    if ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir()):
        raise HFImportError(f"{ckpt_dir} already holds checkpoints; import into a new --workdir")
    sources = plan_import(hf_dir, cfg)
    tok_files = _tokenizer_files(hf_dir)

    mesh = build_mesh(cfg.mesh, devices)
    tx = make_optimizer(cfg)
    _, abstract, shardings = abstract_train_state(cfg, mesh, tx)
    position = stored_position(cfg)  # circular-pipeline runs store layers stage-major
    by_param: dict[tuple[str, ...], list[hf.HFTensor]] = {}
    for t in hf.tensor_table(cfg.model):
        by_param.setdefault(t.param, []).append(t)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(sources), desc="import", unit="tensor", dynamic_ncols=True)

    def build(keypath, target):
        tensors = by_param[_param_path(keypath)]
        if tensors[0].layer is None:
            out = _put(_load(sources[tensors[0].name], tensors[0], target.dtype), target.sharding)
        else:  # one layer at a time into the sharded stacked array
            spec = target.sharding.spec
            layer_sharding = NamedSharding(mesh, P(*spec[1:]) if len(spec) else P())
            set_layer = _set_layer(target.sharding)
            out = jax.jit(lambda: jnp.zeros(target.shape, target.dtype),
                          out_shardings=target.sharding)()
            for t in tensors:
                layer = _put(_load(sources[t.name], t, target.dtype), layer_sharding)
                out = set_layer(out, layer, jnp.int32(position[t.layer]))
                if bar is not None:
                    bar.update(1)
            return out
        if bar is not None:
            bar.update(1)
        return out

    with model_context(mesh):
        params = jax.tree_util.tree_map_with_path(build, abstract["params"])
        opt_state = jax.jit(tx.init, out_shardings=shardings["opt_state"])(params)
        state = {"step": jax.device_put(np.int32(0), shardings["step"]), "params": params,
                 "opt_state": opt_state}
    if bar is not None:
        bar.close()

    saved_cfg, tok_dir = cfg, None
    if tok_files:
        tok_dir = workdir / "hf_tokenizer"
        if not cfg.data.tokenizer:
            saved_cfg = dataclasses.replace(cfg, data=dataclasses.replace(
                cfg.data, tokenizer=str((tok_dir / "tokenizer.json").absolute())))
    ckpt = Checkpointer(ckpt_dir, cfg.checkpoint)
    ckpt.save(0, state, data_state=None, config=saved_cfg.to_dict())
    ckpt.close()
    if tok_dir is not None and jax.process_index() == 0:
        tok_dir.mkdir(parents=True, exist_ok=True)
        for f in tok_files:
            shutil.copyfile(f, tok_dir / f.name)
    log(f"imported {len(sources)} tensors from {hf_dir} into {ckpt_dir}/0"
        + (f"; tokenizer in {tok_dir} (fine-tune with --set data.tokenizer="
           f"{tok_dir / 'tokenizer.json'})" if tok_dir else ""))
    return ImportResult(workdir, 0, len(sources), tok_dir)
