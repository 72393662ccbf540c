"""Llama 3's logical-axis table: for every parameter, the logical names of its axes (model.py
creates each parameter with its entry). Which mesh axis a logical name lands on is decided in
parallel/rules.py alone."""

from __future__ import annotations

PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),  # [V, d]
    "output": ("embed", "vocab"),  # [d, V]; absent with model.tie_embeddings
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
