"""Reading a local Hugging Face model folder: where each tensor is (sharded index or one
model.safetensors), its config.json, and the architecture that config.json names."""

from __future__ import annotations

import json
import pathlib

from titanax.hf.safetensors_io import SafetensorsError, read_header


class HFImportError(ValueError):
    """The HF folder does not match the config (or is damaged); nothing was written."""


def locate(hf_dir: pathlib.Path) -> dict[str, pathlib.Path]:
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


def read_config(hf_dir: pathlib.Path) -> dict | None:
    """The folder's config.json as a dict (None when there is none)."""
    path = pathlib.Path(hf_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFImportError(f"{path}: not valid JSON ({e})") from None


def hf_arch(hf_dir) -> str | None:
    """The model.arch whose HF interop reads the folder's config.json model_type (None without
    a config.json); raises HFImportError for an architecture titanax does not implement."""
    from titanax.models.registry import spec_for_hf

    hf_cfg = read_config(pathlib.Path(hf_dir))
    if hf_cfg is None:
        return None
    try:
        return spec_for_hf(hf_cfg.get("model_type")).arch
    except ValueError as e:
        raise HFImportError(f"{pathlib.Path(hf_dir) / 'config.json'}: {e}") from None
