"""The logical-axis table of a decoder built from the common pieces: for every parameter, the
logical names of its axes (the block and decoder create each parameter with its entry). Which
mesh axis a logical name lands on is decided in parallel/rules.py alone. The names and the
parameter paths are what checkpoints and HF tables are keyed by: they do not change."""

from __future__ import annotations

_DECODER: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),  # [V, D]
    "output": ("embed", "vocab"),  # [D, V]; absent with model.tie_embeddings
    "final_norm": ("norm",),
    # The stacked block: [layers, ...] each.
    "attn_norm": ("layers", "norm"),
    "wq": ("layers", "embed", "heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    # wo and w_down are stored [out, in] (embed first, as HF stores them): FSDP's sharded
    # 'embed' is then each layer's major axis, which XLA:GPU gathers and reduce-scatters in
    # place (embed-last, it kept a transposed copy of the whole stack).
    "wo": ("layers", "embed", "heads", "head_dim"),
    "mlp_norm": ("layers", "norm"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "embed", "mlp"),
}

# Per-head q/k norms (block option qk_norm): one [head_dim] scale per layer shared by all heads,
# replicated ('norm' has no mesh axis in parallel/rules.py).
_QK_NORM: dict[str, tuple[str, ...]] = {
    "q_norm": ("layers", "norm"),
    "k_norm": ("layers", "norm"),
}


def decoder_axes(*, qk_norm: bool = False) -> dict[str, tuple[str, ...]]:
    """The table of a decoder whose block has (or lacks) per-head q/k norms."""
    return {**_DECODER, **(_QK_NORM if qk_norm else {})}


# A mixture-of-experts block (common/moe_block.py): the router and the experts' SwiGLU weights
# in place of the dense MLP's.
_MOE: dict[str, tuple[str, ...]] = {
    "router": ("layers", "embed", "router_experts"),
    "router_bias": ("layers", "router_experts"),  # model.router_bias_update_rate > 0
    "w_gate": ("layers", "expert", "embed", "mlp"),
    "w_up": ("layers", "expert", "embed", "mlp"),
    "w_down": ("layers", "expert", "mlp", "embed"),
}


def moe_decoder_axes(*, qk_norm: bool = False) -> dict[str, tuple[str, ...]]:
    """The table of a decoder whose block is the MoE one."""
    return {**decoder_axes(qk_norm=qk_norm), **_MOE}
