"""The data section: where the tokens come from and how they are packed."""

from __future__ import annotations

from dataclasses import dataclass

from titanax.config.errors import check_choice, check_positive, check_types, fail
from titanax.config.mixture import mixture_string, parse_source

DATA_FORMATS = ("auto", "text", "examples", "chat", "prompt_response")
PACKINGS = ("pack", "pad")  # data/example_rows.py
TRUNCATES = ("right", "drop")


@dataclass(frozen=True)
class DataConfig:
    # 'embedded' (the Python standard library's sources), 'synthetic' (random tokens, for
    # benchmarks), a folder of token shards written by `python -m launch.prepare_data`, or a
    # weighted mixture of such folders: 'a:0.7,b:0.3' (a Python config may give
    # [("a", 0.7), ("b", 0.3)]; it is stored as the string, so checkpoints and --set agree).
    # 'unset' (SOURCE_UNSET): none given yet (launch.import_hf writes it: an imported model
    # has no data of its own); launch.train refuses to start until one is.
    source: str = "embedded"
    tokenizer: str = ""  # tokenizer.json; '' with embedded: trained on first use, cached
    # Held-out share of documents (embedded), tokens (text shards) or examples (example
    # shards); 0 (shard folders only): no validation split, train.eval_every is skipped.
    val_fraction: float = 0.02
    embedded_max_bytes: int = 24_000_000  # cap on the embedded corpus read from disk
    document_masking: bool = True  # attention never crosses packed document boundaries
    shuffle: bool = True  # shuffle windows / examples (seeded by train.seed, resumable)
    # Each document starts with the tokenizer's BOS token (as in Llama 3 pretraining); a shard
    # folder records whether it was written with `prepare_data --bos`, and must agree.
    bos: bool = False
    # A shard folder whose prepare_data was interrupted (meta.json complete: false) trains
    # only with this set: its validation split is the tail of what is there so far, and
    # moves once the folder is finished.
    allow_partial: bool = False
    # What data.source must hold: 'auto' (whatever it holds), 'text' (documents, the loss on
    # every token), or fine-tuning examples with their loss masks: 'examples' (either kind),
    # 'chat' or 'prompt_response' (prepare_data --format). A folder of another kind is
    # refused before training. An import of a model with a chat template sets 'examples'.
    format: str = "auto"
    # Fine-tuning examples in rows of train.seq_len + 1 tokens, never split: 'pack' (first-fit,
    # several per row, each its own segment) or 'pad' (one example per row, then padding).
    packing: str = "pack"
    # An example longer than a row: 'right' keeps its first train.seq_len + 1 tokens, 'drop'
    # leaves it out; the log counts either.
    truncate: str = "right"

    def __post_init__(self):
        if isinstance(self.source, (list, tuple, dict)):
            object.__setattr__(self, "source", mixture_string(self.source))
        check_types("data", self)
        if not self.source:
            fail("data.source", "must be 'embedded', 'synthetic' or a folder of token shards")
        self.folders()  # a malformed mixture fails here, before anything is built
        if not 0.0 <= self.val_fraction < 0.5:
            fail("data.val_fraction", f"must lie in [0, 0.5), got {self.val_fraction}")
        if self.val_fraction == 0 and self.source in ("embedded", "synthetic"):
            fail("data.val_fraction", f"0 (no validation) is for shard folders; data.source="
                 f"{self.source} needs a share in (0, 0.5)")
        check_choice("data.format", self.format, DATA_FORMATS)
        check_choice("data.packing", self.packing, PACKINGS)
        check_choice("data.truncate", self.truncate, TRUNCATES)
        check_positive("data", self, "embedded_max_bytes")

    @property
    def masks_documents(self) -> bool:
        """Whether the train step passes segment ids to attention: document_masking, unless
        the source has no documents (synthetic random tokens: every row is one segment, and
        all-equal ids would only send attention down the masked path of a packed-document
        kernel for nothing)."""
        return self.document_masking and self.source != "synthetic"

    def folders(self) -> list[tuple[str, float]]:
        """(folder, weight) per shard folder of data.source: [] for embedded/synthetic, one
        entry (weight 1.0) for a plain folder, several for a mixture (weights as written)."""
        return parse_source(self.source)
