"""The quantities of one train step that the memory, compute and communication models all read:
mesh degrees, accumulation and pipeline microbatching, tokens, activation width in bytes.

A device holds the tokens of its share of the rows (parallel/rules.py's 'batch': data x fsdp,
and expert for a mixture of experts, whose expert ranks are data-parallel ones outside the
experts) and of its share of each sequence ('seq': context): every per-device token count
here is."""

from __future__ import annotations

import dataclasses

from titanax.config import Config
from titanax.config.parallel import batch_ways
from titanax.parallel.rules import ACTIVATION_RULES

_ACTIVATIONS = dict(ACTIVATION_RULES)


def activation_axes(name: str) -> tuple[str, ...]:
    """The mesh axes the activation rule `name` ('batch', 'seq') splits over."""
    entry = _ACTIVATIONS[name]
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class StepShape:
    deg: dict[str, int]  # mesh degree per axis: pipeline, data, fsdp, expert, context, tensor
    accum: int  # train.grad_accum
    micro: int  # pipeline microbatches (1 without a pipeline)
    virtual: int  # virtual stages per device (1 without a pipeline)
    tokens: int  # per step, whole cluster
    act_bytes: int  # bytes of one activation value in the compute dtype
    # Mean tokens per packed document when the step masks documents (plan/documents.py);
    # None: no documents, or of unknown length (attention counted as plain causal).
    doc_tokens: float | None = None

    @classmethod
    def of(cls, cfg: Config, deg: dict[str, int], doc_tokens: float | None = None) -> StepShape:
        pp = deg["pipeline"]
        return cls(deg=deg, accum=cfg.train.grad_accum,
                   micro=cfg.pipeline.microbatches if pp > 1 else 1,
                   virtual=cfg.pipeline.resolved_virtual_stages if pp > 1 else 1,
                   tokens=cfg.train.batch_size * cfg.train.seq_len,
                   act_bytes=4 if cfg.execution.dtype == "float32" else 2, doc_tokens=doc_tokens)

    @property
    def context(self) -> int:
        """Devices each sequence is split over (mesh.context; 1 without context parallelism)."""
        return self.deg.get("context", 1)

    @property
    def tokens_pipe_micro(self) -> float:
        """Tokens of one (accumulation, pipeline) microbatch on one device: its share of the
        rows (batch_ways) and of each sequence (all of it without context parallelism)."""
        return self.tokens / (self.accum * batch_ways(self.deg) * self.context * self.micro)
