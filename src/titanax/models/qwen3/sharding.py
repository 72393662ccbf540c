"""Qwen3's logical-axis table: Llama's, plus the per-head q/k norm scales (one [head_dim]
scale per layer, replicated: 'norm' has no mesh axis in parallel/rules.py)."""

from __future__ import annotations

from titanax.models.llama3.sharding import PARAM_AXES as _LLAMA3

PARAM_AXES: dict[str, tuple[str, ...]] = {
    **_LLAMA3,
    "q_norm": ("layers", "norm"),
    "k_norm": ("layers", "norm"),
}
