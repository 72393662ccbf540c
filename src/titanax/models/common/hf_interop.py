"""What an architecture's hf.py provides (HFInterop, the `hf` field of its ModelSpec), and the
pieces every such table is made of: HFTensor and the per-tensor layout transforms.

HF stores every projection as a torch Linear weight [out_features, in_features]; titanax keeps
the head structure ([d, H, hd]) and stacks layers. titanax.hf (import and export) reads these
tables and knows no architecture.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from titanax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class HFTensor:
    name: str  # HF state-dict key
    param: tuple[str, ...]  # titanax parameter path, e.g. ('layers', 'wq')
    layer: int | None  # index into the stacked [L, ...] parameter; None: not stacked
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]  # titanax shape of this tensor (one layer's slice when stacked)
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray], np.ndarray]
    # Index into a stacked [L, E, ...] expert parameter after the layer (the hub stores each
    # expert of a MoE layer as its own tensor); None: the parameter has no expert axis.
    expert: int | None = None


@dataclasses.dataclass(frozen=True)
class HFInterop:
    """One architecture's HF interop: its tensor table and config.json in both directions."""
    model_type: str  # config.json's model_type this architecture reads and writes
    # tensor_table(cfg) -> [HFTensor], in the order export writes them
    tensor_table: Callable[[ModelConfig], list[HFTensor]]
    # to_config(cfg, *, dtype, bos_id, eos_id) -> config.json as a dict
    to_config: Callable[..., dict]
    # from_config(config.json dict) -> {'model.field': value} (raises ValueError if unsupported)
    from_config: Callable[[dict], dict]
    # (output layer, input embedding) HF names: a tied checkpoint has only the second.
    tied_names: tuple[str, str] = ("lm_head.weight", "model.embed_tokens.weight")
    # config.json keys titanax writes but does not use, where an imported source's own value
    # is kept on export (hf/source.merge_config): e.g. Qwen3-MoE's dense intermediate_size.
    source_keeps: tuple[str, ...] = ()

    def mismatches(self, hf: dict, cfg: ModelConfig) -> list[str]:
        """'model.field=ours but config.json says theirs' for every field that disagrees."""
        return config_mismatches(self.from_config(hf), cfg)


def _identity(x):
    return x


def _transpose(x):
    return x.T


def _heads_in(shape):  # [d, H, hd] <-> [H*hd, d]
    d = shape[0]
    return (lambda x: x.reshape(d, -1).T), (lambda y: y.T.reshape(shape))


def _heads_out(shape):  # [d, H, hd] <-> [d, H*hd]
    d = shape[0]
    return (lambda x: x.reshape(d, -1)), (lambda y: y.reshape(shape))


def entry(name: str, param: tuple[str, ...], layer: int | None, shape, kind: str,
          expert: int | None = None) -> HFTensor:
    """One table row; kind: 'copy', 'transpose' (a [in, out] Linear), 'heads_in' ([d, H, hd]
    <-> [H*hd, d], q/k/v) or 'heads_out' ([d, H, hd] <-> [d, H*hd], o_proj)."""
    if kind == "copy":
        to_hf = from_hf = _identity
        hf_shape = shape
    elif kind == "transpose":
        to_hf = from_hf = _transpose
        hf_shape = shape[::-1]
    elif kind == "heads_in":
        to_hf, from_hf = _heads_in(shape)
        hf_shape = (shape[1] * shape[2], shape[0])
    elif kind == "heads_out":
        to_hf, from_hf = _heads_out(shape)
        hf_shape = (shape[0], shape[1] * shape[2])
    else:
        raise ValueError(f"unknown HF tensor transform {kind!r}")
    return HFTensor(name, param, layer, tuple(hf_shape), tuple(shape), to_hf, from_hf,
                    expert)


def config_mismatches(theirs_by_key: dict, cfg: ModelConfig) -> list[str]:
    """The fields of from_config's result that disagree with cfg, with the --set that fixes
    each. Tying is one-way: an untied config may take a tied checkpoint (the output layer
    starts as the embedding), not the reverse."""
    problems = []
    for key, theirs in theirs_by_key.items():
        field = key.split(".", 1)[1]
        ours = cfg.resolved_head_dim if field == "head_dim" else getattr(cfg, field)
        if cfg.rope_scaling == "none" and field.startswith("rope_") and field not in (
                "rope_theta", "rope_scaling"):
            continue  # scaling parameters mean nothing without scaling
        if field == "tie_embeddings" and theirs and not ours:
            continue
        same = (math.isclose(float(ours), float(theirs), rel_tol=1e-6)
                if isinstance(theirs, float) or isinstance(ours, float) else ours == theirs)
        if not same:
            problems.append(f"{key}={ours!r} but config.json says {theirs!r} "
                            f"(--set {key}={theirs})")
    return problems
