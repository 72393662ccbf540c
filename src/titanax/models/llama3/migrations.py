"""Old Llama checkpoints (ModelSpec.legacy_transposes): the parameter layouts titanax wrote
before, and how a stored leaf becomes the current layout. checkpoint/migrations.py asks the spec
and applies them (to the parameter and its optimizer moments alike) on restore and in
checkpoint/reader.py, so every checkpoint a user has keeps loading.

Layout 2 (checkpoint/migrations.py PARAM_LAYOUT) stores wo as [L, D, H, K] and w_down as
[L, D, F] (embed first, as HF does); steps written before held [L, H, K, D] and [L, F, D]."""

from __future__ import annotations

from titanax.config import ModelConfig

# name under 'layers' -> the permutation taking the old array to the current one
# (current = old.transpose(perm)).
LEGACY_TRANSPOSES = {"wo": (0, 3, 1, 2),  # [L, H, K, D] -> [L, D, H, K]
                     "w_down": (0, 2, 1)}  # [L, F, D] -> [L, D, F]


def legacy_transposes(model: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """{name under 'layers': (perm, its current shape at model's dimensions)}."""
    L, D, K = model.n_layers, model.d_model, model.resolved_head_dim
    current = {"wo": (L, D, model.n_heads, K), "w_down": (L, D, model.ffn_dim)}
    return {name: (perm, current[name]) for name, perm in LEGACY_TRANSPOSES.items()}
