"""How long the packed documents of a run are, and what that does to attention's work.

With document masking, attention never crosses a document boundary, and the flash kernels
skip every key tile before a query tile's document start (pallas_kernels/flash_attention/
tile_ranges.py). A query then sees on average about half its document instead of half the
window: with 2k-token documents in 8k windows about a quarter of the causal work. The planner
takes the mean document length from the shard folders' meta.json (tokens / documents, as
`launch.prepare_data` records them) or from `launch.plan --doc-len N`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import pathlib

from titanax.config import Config

# The kernels' tile edge the estimate rounds to (128 x 128 tiles: sm90's CTA rows and key
# tiles, sm100's TMEM lanes): a document costs whole tiles, its boundary tiles included.
TILE = 128

# `launch.plan --doc-len N`: the mean document length to plan with, over meta.json's.
_ASSUMED: contextvars.ContextVar[float | None] = contextvars.ContextVar("doc_tokens",
                                                                        default=None)


@contextlib.contextmanager
def assume_document_tokens(doc_tokens: float | None):
    """Plan with documents of this mean length (None: what the shard folders say)."""
    token = _ASSUMED.set(doc_tokens)
    try:
        yield
    finally:
        _ASSUMED.reset(token)


@functools.cache
def _folder_doc_tokens(folder: str) -> tuple[int, int] | None:
    """(tokens, documents) of a shard folder from its meta.json, or None when unreadable."""
    try:
        meta = json.loads((pathlib.Path(folder) / "meta.json").read_text())
        shards = meta["shards"]
        return (sum(int(s["n_tokens"]) for s in shards), sum(int(s["n_docs"]) for s in shards))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mean_document_tokens(cfg: Config) -> float | None:
    """Mean tokens per document: assume_document_tokens's, else cfg's shard folders' (a
    mixture weighs each folder by its share); None: no documents in the step (synthetic data,
    document_masking off) or no readable meta.json."""
    if not cfg.data.masks_documents:
        return None
    if _ASSUMED.get() is not None:
        return float(_ASSUMED.get())
    folders = cfg.data.folders()
    counts = [(_folder_doc_tokens(f), w) for f, w in folders]
    if not counts or any(c is None or c[1] == 0 for c, _ in counts):
        return None
    total = sum(w for _, w in counts)
    return sum(w / total * (c[0] / c[1]) for c, w in counts)


def attention_share(cfg: Config, doc_tokens: float | None) -> float:
    """The share of the full S x S scores the step's attention computes per layer pass.

    Plain causal: 1/2. Packed documents of mean length L < S: each query tile of TILE rows
    visits the tiles from its document's start to the diagonal, about L/2 + TILE keys per
    query (the partial tiles at both ends included): (L/2 + TILE) / S, never above 1/2.
    attention_impl=cudnn with documents takes them as a dense mask: every score, 1."""
    causal = 0.5
    if doc_tokens is None or not cfg.data.masks_documents:
        return causal
    if cfg.execution.attention_impl == "cudnn":
        return 1.0
    return min(causal, (doc_tokens / 2 + TILE) / cfg.train.seq_len)


def documents_summary(cfg: Config) -> dict:
    """plan.json's "documents": whether the step masks documents, their mean length and
    where it came from, and the share of the S x S scores attention computes."""
    masks = cfg.data.masks_documents
    mean = mean_document_tokens(cfg)
    source = (None if mean is None else "--doc-len" if _ASSUMED.get() is not None
              else "meta.json")
    return {"masked": masks, "mean_tokens": mean, "source": source,
            "attention_share": attention_share(cfg, mean)}
