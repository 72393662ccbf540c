"""Mistral-7B-style dense: the common decoder's fields and `sliding_window` (Mistral-7B-v0.1:
4096 of 32768 positions). titanax does not implement sliding-window attention, so only a window
that hides nothing is taken: 0 (none, v0.2+'s null) or one at least model.max_seq_len long,
where every position sees its whole prefix anyway. The HF import reads it from config.json and
the export writes it back."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.errors import fail
from titanax.config.model import PlainRopeModelConfig


@dataclass(frozen=True)
class MistralConfig(PlainRopeModelConfig):
    arch: str = "mistral"
    sliding_window: int = 0  # attention window in tokens (0: none); only one hiding nothing is taken

    def __post_init__(self):
        super().__post_init__()
        if self.sliding_window < 0:
            fail("model.sliding_window", f"must be >= 0 (0: none), got {self.sliding_window}")
        if 0 < self.sliding_window < self.max_seq_len:
            fail("model.sliding_window", f"{self.sliding_window} (below model.max_seq_len="
                 f"{self.max_seq_len}) is not supported: titanax's Mistral attends to the whole "
                 "prefix; set 0 (none), or model.max_seq_len at most the window")


CONFIG = MistralConfig
