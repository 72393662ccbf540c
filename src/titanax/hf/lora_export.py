"""A LoRA run's adapters on the way out (docs/lora.md "Export"): merged into the weights an HF
export writes, or as a PEFT adapter folder (adapter_config.json + adapter_model.safetensors)
that `peft.PeftModel.from_pretrained(base, folder)` loads onto the base.

titanax keeps, for a weight W [layers, ...] used as einsum(x, W, spec), A [layers, W's input
axes..., r] and B [layers, r, W's output axes...] (models/common/lora.py). PEFT keeps, for the
torch Linear the export writes W as ([out_features, in_features]), lora_A.weight [r, in] and
lora_B.weight [out, r], and adds scaling * B_hf A_hf with scaling = lora_alpha / r, the same
alpha / r titanax uses. The architecture's export transform (to_hf) only moves W's entries
(reshapes and transposes), so where each input and output index of W lands in the HF matrix
is read off by sending index grids through it; no architecture is named here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

from titanax.config import Config
from titanax.models.common.block import PROJECTION_SPECS
from titanax.models.common.hf_interop import HFTensor
from titanax.models.common.lora import adapter_shapes

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's prefix of a causal LM's adapter keys (PeftModelForCausalLM.base_model.model).
_PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class AdaptedTensor:
    """One HF tensor of a weight with an adapter: where its A and B are stored, and how A B
    maps onto W's axes."""
    tensor: HFTensor
    a_param: tuple[str, ...]
    b_param: tuple[str, ...]
    spec: str  # the projection's einsum spec (models/common/block.py PROJECTION_SPECS)


def adapted_tensors(cfg: Config, table: list[HFTensor]) -> dict[str, AdaptedTensor]:
    """{HF name: AdaptedTensor} for every tensor of the table whose weight has an adapter
    (cfg.lora.weights). Each adapted weight must be one HF tensor per layer."""
    out = {}
    for weight in cfg.lora.weights:
        rows = [t for t in table if t.param == ("layers", weight)]
        if len(rows) != cfg.model.n_layers or len({t.layer for t in rows}) != len(rows):
            raise ValueError(f"model.arch={cfg.model.arch!r}: layers.{weight} is not written as "
                             "one HF tensor per layer, which exporting its LoRA adapter needs")
        for t in rows:
            out[t.name] = AdaptedTensor(t, ("layers", f"{weight}_lora_a"),
                                        ("layers", f"{weight}_lora_b"), PROJECTION_SPECS[weight])
    return out


def _axis_order(spec: str, layer_shape: tuple[int, ...]):
    """(W's input axes, W's output axes, the permutation from [in..., out...] to W's order)
    for one layer's W of shape layer_shape."""
    _, _, a_pos, b_pos = adapter_shapes((1, *layer_shape), spec, 1)
    positions = [p - 1 for p in a_pos] + [p - 1 for p in b_pos]
    return ([layer_shape[p - 1] for p in a_pos], [layer_shape[p - 1] for p in b_pos],
            tuple(int(i) for i in np.argsort(positions)))


def merged_layer(t: AdaptedTensor, w: np.ndarray, a: np.ndarray, b: np.ndarray,
                 scale: float) -> np.ndarray:
    """One layer's W + scale * A B in W's layout, float32 (then to_hf as the base weight)."""
    _, _, perm = _axis_order(t.spec, w.shape)
    delta = np.tensordot(a.astype(np.float32), b.astype(np.float32), axes=([-1], [0]))
    return w.astype(np.float32) + np.float32(scale) * delta.transpose(perm)


def peft_factors(t: AdaptedTensor, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (lora_A [r, in_features], lora_B [out_features, r]) for the HF tensor t.

    Index grids of W's shape, holding the flat input (or output) index of each entry, go
    through to_hf; row 0 (column 0) of the result then says which of our input (output)
    indices each HF column (row) holds."""
    ins, outs, perm = _axis_order(t.spec, t.tensor.shape)
    n_in, n_out, r = math.prod(ins), math.prod(outs), a.shape[-1]
    grid_in = np.broadcast_to(np.arange(n_in).reshape(ins + [1] * len(outs)), ins + outs)
    grid_out = np.broadcast_to(np.arange(n_out).reshape([1] * len(ins) + outs), ins + outs)
    hf_in = np.asarray(t.tensor.to_hf(grid_in.transpose(perm)))
    hf_out = np.asarray(t.tensor.to_hf(grid_out.transpose(perm)))
    if hf_in.shape != (n_out, n_in) or (hf_in != hf_in[:1]).any() or (
            hf_out != hf_out[:, :1]).any():
        raise ValueError(f"{t.tensor.name}: its HF layout is not [out_features, in_features] of "
                         "the projection, which a PEFT LoRA adapter needs")
    lora_a = a.reshape(n_in, r)[hf_in[0]].T
    lora_b = b.reshape(r, n_out)[:, hf_out[:, 0]].T
    return np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b)


def peft_names(hf_name: str) -> tuple[str, str]:
    """PEFT's keys of the adapter on the HF weight `hf_name` (e.g.
    'model.layers.0.self_attn.q_proj.weight' -> 'base_model.model.model.layers.0.self_attn.
    q_proj.lora_A.weight' and its lora_B)."""
    module = hf_name.removesuffix(".weight")
    return (f"{_PEFT_PREFIX}{module}.lora_A.weight", f"{_PEFT_PREFIX}{module}.lora_B.weight")


def adapter_base(workdir, base_model_id: str | None = None) -> tuple[str | None, str | None]:
    """(base_model_name_or_path, revision) of the run's adapter export: `base_model_id`
    ('org/name' or 'org/name@revision') when given, the recorded commit kept when it names the
    recorded hub id; else what the import recorded (hf/source.py base_origin): a hub id and its
    commit, a folder of the hub cache read as the hub id and commit it is a snapshot of
    (models--ORG--NAME/snapshots/COMMIT), any other folder as its path; (None, None) for a run
    that was not imported. ValueError for a malformed base_model_id."""
    from titanax.hf.hub import hub_id
    from titanax.hf.source import base_origin

    name, revision = base_origin(pathlib.Path(workdir))
    if base_model_id is not None:
        parsed = hub_id(base_model_id)
        if parsed is None:
            raise ValueError(f"--base-model-id {base_model_id}: give the base model's hub id as "
                             "org/name (or org/name@revision)")
        repo, asked = parsed
        return repo, asked or (revision if repo == name else None)
    if name is not None:
        path = pathlib.Path(name)
        if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
            parts = path.parent.parent.name.removeprefix("models--").split("--")
            if len(parts) == 2 and hub_id("/".join(parts)) is not None:
                return "/".join(parts), path.name
    return name, revision


def is_hub_base(base: tuple[str | None, str | None]) -> bool:
    """Whether an adapter's base names a hub model (anyone can load it), not a local folder."""
    from titanax.hf.hub import hub_id

    return base[0] is not None and hub_id(base[0]) is not None and \
        not pathlib.Path(base[0]).expanduser().is_absolute()


def adapter_config(cfg: Config, adapted: dict[str, AdaptedTensor],
                   base: tuple[str | None, str | None]) -> dict:
    """adapter_config.json as PEFT's LoraConfig writes it for these adapters; base: (hub id or
    folder, hub commit) of the base (adapter_base)."""
    modules = sorted({name.removesuffix(".weight").rsplit(".", 1)[1] for name in adapted})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base[0],
            "revision": base[1],
            "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False,
            "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def write_adapter_config(path: pathlib.Path, cfg: Config, adapted, base) -> None:
    path.write_text(json.dumps(adapter_config(cfg, adapted, base), indent=2) + "\n")


# export_hf's `lora`: the weights with the adapters merged in, a PEFT adapter folder instead
# of the model, or the frozen base alone.
LORA_EXPORTS = ("merged", "adapter", "base")


def check_mode(mode: str) -> None:
    """Refuses a `lora` export_hf does not know, before anything is read."""
    if mode not in LORA_EXPORTS:
        raise ValueError(f"lora {mode!r}: choose one of {list(LORA_EXPORTS)}")


@dataclasses.dataclass(frozen=True)
class AdapterExport:
    """What an export does with a step's adapters: mode (LORA_EXPORTS) and adapted, the HF
    tensors with an adapter in the step ({} for a step without any)."""
    mode: str
    adapted: dict[str, AdaptedTensor]

    @property
    def folder(self) -> bool:
        """A PEFT adapter folder is written instead of the model."""
        return self.mode == "adapter"

    @property
    def merged(self) -> dict[str, AdaptedTensor] | None:
        """The tensors the model is written with their adapter merged in (None: every
        tensor as stored)."""
        return self.adapted if self.mode == "merged" else None

    def tensor_count(self, table: list[HFTensor]) -> int:
        """The HF tensors the export writes (its progress bar's total)."""
        return len(self.adapted) if self.folder else len(table)


def adapter_export(reader, cfg: Config, table: list[HFTensor], mode: str) -> AdapterExport:
    """The export's AdapterExport for the step `reader` reads (checkpoint/reader.py): its
    adapters when the run has any; 'adapter' of a step without them is refused, as are
    adapters of lora.targets the step does not store."""
    if not cfg.lora.enabled or not reader.adapters():
        if mode == "adapter":
            raise ValueError(f"{reader.state_dir.parent} holds no LoRA adapters (lora.rank="
                             f"{cfg.lora.rank}): export it without --adapter")
        return AdapterExport(mode, {})
    adapted = adapted_tensors(cfg, table)
    missing = sorted({".".join(p) for t in adapted.values() for p in (t.a_param, t.b_param)}
                     - {".".join(p) for p in reader.adapters()})
    if missing:
        raise ValueError(f"{reader.state_dir.parent}: adapters {missing} of lora.targets="
                         f"{cfg.lora.targets!r} are not stored")
    return AdapterExport(mode, adapted)
