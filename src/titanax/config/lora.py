"""The lora section: low-rank adapters on the decoder's projections (docs/lora.md). rank=0 (the
default) is off: the model, its state and its compiled step are exactly those without it."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.errors import check_types, fail

# targets name -> the decoder block's weight (models/common/block.py)
LORA_TARGETS = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up",
                "down": "w_down"}


@dataclass(frozen=True)
class LoraConfig:
    # The adapters' rank r: each target weight W gets A [in, r] and B [r, out] (B starts at 0,
    # so step 0 is the base model); 0: no adapters.
    rank: int = 0
    # The adapter's output is scaled by alpha / rank (the LoRA paper's and PEFT's scaling).
    alpha: float = 16.0
    # Dropout on the adapter's input in training (PEFT's lora_dropout): the adapter sees
    # dropout(x), the base x; masks drawn from train.seed and the step; 0.0: none.
    dropout: float = 0.0
    # Which projections get adapters, comma-separated: q, k, v, o, gate, up, down.
    targets: str = "q,k,v,o,gate,up,down"

    def __post_init__(self):
        check_types("lora", self)
        if self.rank < 0:
            fail("lora.rank", f"must be >= 0 (0: no adapters), got {self.rank}")
        if self.alpha <= 0:
            fail("lora.alpha", f"must be > 0 (the adapters are scaled by alpha / rank), got "
                 f"{self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            fail("lora.dropout", f"must lie in [0, 1), got {self.dropout}")
        names = [t.strip() for t in self.targets.split(",")]
        unknown = [t for t in names if t not in LORA_TARGETS]
        if unknown or not self.targets.strip():
            fail("lora.targets", f"{self.targets!r}: name projections among "
                 f"{','.join(LORA_TARGETS)}, comma-separated (unknown: {unknown})")
        if len(set(names)) != len(names):
            fail("lora.targets", f"{self.targets!r} names a projection twice")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank: what the adapter's product is multiplied by."""
        return self.alpha / self.rank if self.rank else 0.0

    @property
    def weights(self) -> tuple[str, ...]:
        """The block weights with adapters, in the block's order (wq .. w_down)."""
        chosen = {LORA_TARGETS[t.strip()] for t in self.targets.split(",")} if self.rank else ()
        return tuple(w for w in LORA_TARGETS.values() if w in chosen)

    # --- What the run-wide checks (config/rules.py) ask of this section.
    def check_run(self, cfg) -> None:
        """What LoRA (rank > 0) cannot run with yet, one line each (cfg: the Config)."""
        if not self.enabled:
            return
        for name in ("offload_params", "offload_optimizer"):
            if getattr(cfg.train, name):
                # The streamed update (train/offload.py) walks the base weights' layers; the
                # adapters and their moments are small enough to need no offload at all.
                fail(f"train.{name}", f"does not run with lora.rank={self.rank} yet: the "
                     "host-offloaded update streams the base weights, which LoRA never "
                     f"updates; set train.{name}=false (the adapters' state is small)")

    def check_pipeline_schedule(self, schedule: str) -> None:
        """A pipelined run's schedule (mesh.pipeline > 1)."""
        if self.enabled and schedule == "1f1b":
            fail("pipeline.schedule", "1f1b computes every layer weight's gradient inside its "
                 "own backward schedule, so with lora.rank > 0 it would compute (and drop) the "
                 "frozen base's; use pipeline.schedule=gpipe or circular")

    def plain_accumulation_reason(self) -> str | None:
        """Why the microbatch gradients are summed the plain way (rules.py
        grad_accum_in_place_unsupported), or None."""
        if self.enabled:
            # The in-place sum rides on the base weights' layer scan; LoRA differentiates only
            # the adapters, whose plain sum is a small carry.
            return "lora.rank > 0: only the adapters get gradients, summed the plain way"
        return None
