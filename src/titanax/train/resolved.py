"""A run's config resolved once per entry: the Trainer, the memory check
(train/memory_fit.py), HF import and export, sampling and the benchmarks each build one
Resolved and pass it, or its spec, down; nothing below them looks the spec up again. (The
checkpoint layer, below this one, looks up a saved step's own spec in
checkpoint/migrations.py: that step's config, not the run's, says how it was stored.)"""

from __future__ import annotations

import dataclasses

from titanax.config import Config
from titanax.models.registry import model_spec
from titanax.models.spec import ModelSpec


@dataclasses.dataclass(frozen=True)
class Resolved:
    """cfg and the ModelSpec its model.arch names (models/spec.py: build, hooks, HF interop)."""
    cfg: Config
    spec: ModelSpec

    @property
    def hf(self):
        """The architecture's HF interop (models/common/hf_interop.HFInterop); ValueError
        naming model.arch when it has none (it can be neither imported nor exported)."""
        if self.spec.hf is None:
            raise ValueError(f"model.arch={self.cfg.model.arch!r} has no Hugging Face export "
                             "or import")
        return self.spec.hf


def resolve(cfg: Config) -> Resolved:
    """The one lookup of cfg.model's spec (a ConfigError naming model.arch for an unknown
    one), made by each entry once."""
    return Resolved(cfg, model_spec(cfg.model))
