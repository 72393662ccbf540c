"""LoRA in the planner (docs/lora.md): how many adapter parameters a config trains and how a
device's share of them is cut. Imports no jax, so the count can be checked on its own against
the built model's adapters (tests/test_plan_lora.py).

A block weight W [layers, in..., out...] with an adapter gets A [layers, in..., r] and
B [layers, r, out...] (models/common/lora.py). Each factor carries one of W's two feature axes
and 'lora_rank', which maps to no mesh axis (parallel/rules.py), so the two factors shard
differently: the factor on W's 'embed' side (A of the column projections wq, wk, wv, w_gate,
w_up; B of the row projections wo, w_down) over fsdp x context like the weight's embed axis,
the factor on its heads / kv_heads / mlp side over tensor. Neither is split over the other:
with FSDP alone, the heads / mlp side of every adapter is whole on every device.
"""

from __future__ import annotations

import dataclasses

from titanax.config import LoraConfig, ModelConfig


def projection_widths(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """Block weight -> (its input width, its output width); d_model is the 'embed' side."""
    d, hd = m.d_model, m.resolved_head_dim
    q, kv, f = m.n_heads * hd, m.n_kv_heads * hd, m.ffn_dim
    return {"wq": (d, q), "wk": (d, kv), "wv": (d, kv), "wo": (q, d),
            "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}


@dataclasses.dataclass(frozen=True)
class AdapterParams:
    """One layer's adapter elements by how they shard, and the layer count."""
    embed_side: int  # per layer: the factors on W's d_model axis (fsdp x context)
    other_side: int  # per layer: the factors on W's heads / kv_heads / mlp axis (tensor)
    n_layers: int

    @property
    def per_layer(self) -> int:
        return self.embed_side + self.other_side

    @property
    def total(self) -> int:
        return self.n_layers * self.per_layer

    def per_device(self, deg: dict[str, int]) -> float:
        """Elements on one device: layers over pipeline, each side over its own mesh axes."""
        shards = deg["fsdp"] * deg.get("context", 1)
        return (self.n_layers / deg["pipeline"]
                * (self.embed_side / shards + self.other_side / deg["tensor"]))

    def sides_over_tensor_pipeline(self, deg: dict[str, int]) -> tuple[float, float]:
        """(embed side, other side) elements of one tensor x pipeline coordinate, whole over
        fsdp x context: what the FSDP group reduces."""
        layers = self.n_layers / deg["pipeline"]
        return layers * self.embed_side, layers * self.other_side / deg["tensor"]


def adapter_params(m: ModelConfig, lora: LoraConfig) -> AdapterParams:
    """The adapters of lora.weights: rank x (in + out) elements per weight and layer, its
    d_model side and its other side apart (zero when lora.rank is 0)."""
    widths = projection_widths(m)
    embed = sum(lora.rank * m.d_model for w in lora.weights)
    other = sum(lora.rank * (widths[w][0] + widths[w][1] - m.d_model) for w in lora.weights)
    return AdapterParams(embed, other, m.n_layers)


def adapter_param_count(m: ModelConfig, lora: LoraConfig) -> int:
    """How many adapter parameters lora trains on model m (all layers): the sum over the
    chosen projections of rank x (in + out), times n_layers."""
    return adapter_params(m, lora).total
