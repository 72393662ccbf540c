"""Training rows of whole fine-tuning examples: an example is never split between rows.

A row is seq_len + 1 tokens holding one or more examples back to back, then padding. Inputs
are the row's first seq_len tokens and targets its last seq_len, as for text; a target bears
loss only where the example's mask says so (data/examples.py) and the input before it is of
the same example, so no example is ever predicted from another. Every example is a segment of
its own (attention stays inside it, positions restart at 0); the padding is one more segment,
so segment ids never decrease along a row (what packed-document kernels skip tiles by).

data.packing: 'pack' places examples first-fit (each into the first row with room, in a
seeded order), 'pad' puts one example per row. data.truncate: an example longer than a row
keeps its first seq_len + 1 tokens ('right') or is left out ('drop'); both are counted.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from titanax.config.data import PACKINGS, TRUNCATES
from titanax.data.errors import DataError

IGNORE_INDEX = -100  # titanax.ops.IGNORE_INDEX (data/ sits below ops/ in the layering)


@dataclasses.dataclass(frozen=True)
class ExampleSet:
    """Examples spread over shards, addressed by a global example index."""

    tokens: list   # per shard, 1-D token arrays (memory-mapped)
    masks: list    # per shard, 1-D uint8 loss masks
    shard: np.ndarray   # [n] the shard of each example
    start: np.ndarray   # [n] its first token in that shard
    length: np.ndarray  # [n] its number of tokens

    @classmethod
    def from_shards(cls, tokens: list, masks: list, offsets: list) -> ExampleSet:
        shard = np.concatenate([np.full(len(o) - 1, k, np.int32) for k, o in enumerate(offsets)])
        start = np.concatenate([np.asarray(o[:-1], np.int64) for o in offsets])
        length = np.concatenate([np.diff(np.asarray(o, np.int64)) for o in offsets])
        return cls(tokens, masks, shard, start, length)

    def __len__(self) -> int:
        return len(self.length)

    def example(self, i: int, keep: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) of example i, its first `keep` tokens."""
        k, lo = int(self.shard[i]), int(self.start[i])
        n = min(int(self.length[i]), keep)
        return np.asarray(self.tokens[k][lo:lo + n]), np.asarray(self.masks[k][lo:lo + n])


class ExampleRows:
    """The rows of a set of examples (indices into an ExampleSet), fixed once built: grain
    shuffles the rows per epoch like text windows, so resume stays one index."""

    def __init__(self, examples: ExampleSet, indices: np.ndarray, seq_len: int, *,
                 packing: str = "pack", truncate: str = "right", seed: int | None = None):
        if packing not in PACKINGS or truncate not in TRUNCATES:
            raise ValueError(f"packing {packing!r} / truncate {truncate!r}")
        self.examples, self.width = examples, seq_len + 1
        lengths = examples.length[indices]
        too_long = lengths > self.width
        self.n_truncated = int(too_long.sum()) if truncate == "right" else 0
        self.n_dropped = int(too_long.sum()) if truncate == "drop" else 0
        keep = indices[~too_long] if truncate == "drop" else np.asarray(indices)
        if seed is not None:  # which examples share a row: seeded, not the file order
            keep = keep[np.random.default_rng(seed).permutation(len(keep))]
        sizes = np.minimum(examples.length[keep], self.width)
        bins = np.arange(len(keep)) if packing == "pad" else first_fit(sizes, self.width)
        order = np.argsort(bins, kind="stable")  # examples row by row, in placement order
        self.members = keep[order]
        self.row_starts = np.searchsorted(bins[order], np.arange(bins.max(initial=-1) + 2))
        self.n_examples = len(keep)
        self.fill = float(sizes.sum()) / max(len(self) * self.width, 1)
        self.summary = ""  # the data source's log line (data/example_source.py)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def rows(self, indices) -> np.ndarray:
        """int32 [len(indices), 3, seq_len]: inputs, targets (IGNORE_INDEX where no loss),
        segment ids."""
        return np.stack([self._row(int(i)) for i in indices])

    def _row(self, r: int) -> np.ndarray:
        ids = np.zeros(self.width, np.int64)
        mask = np.zeros(self.width, bool)
        seg = np.zeros(self.width, np.int32)
        at = 0
        for s, i in enumerate(self.members[self.row_starts[r]:self.row_starts[r + 1]], 1):
            x, m = self.examples.example(int(i), self.width)
            ids[at:at + len(x)], mask[at:at + len(x)], seg[at:at + len(x)] = x, m, s
            at += len(x)
        seg[at:] = seg[at - 1] + 1 if at else 1  # the padding: one segment after the last
        same = seg[1:] == seg[:-1]
        targets = np.where(mask[1:] & same & (np.arange(1, self.width) < at), ids[1:],
                           IGNORE_INDEX)
        return np.stack([ids[:-1], targets, seg[:-1]]).astype(np.int32)

    def describe(self) -> str:
        cut = (f", {self.n_truncated} truncated to {self.width} tokens" if self.n_truncated
               else f", {self.n_dropped} longer than {self.width} tokens dropped"
               if self.n_dropped else "")
        return f"{self.n_examples} examples in {len(self)} rows ({self.fill:.0%} full{cut})"


def first_fit(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """The row of each item, first-fit: each goes into the first row with room for it (a max
    segment tree over the rows' free space finds it in log time)."""
    n = len(sizes)
    leaves = 1
    while leaves < max(n, 1):
        leaves *= 2
    free = np.zeros(2 * leaves, np.int64)
    free[leaves:leaves + n] = capacity  # at most one row per item
    for v in range(leaves - 1, 0, -1):
        free[v] = max(free[2 * v], free[2 * v + 1])
    bins = np.empty(n, np.int64)
    for j, size in enumerate(sizes.tolist()):
        v = 1
        while v < leaves:  # the leftmost child with room
            v = 2 * v if free[2 * v] >= size else 2 * v + 1
        bins[j] = v - leaves
        free[v] -= size
        v //= 2
        while v:
            free[v] = max(free[2 * v], free[2 * v + 1])
            v //= 2
    # rows are numbered in first use order already: row k opens only after rows 0..k-1
    return bins


def pack_example_rows(rows: np.ndarray) -> dict:
    """[B, 3, seq_len] example rows -> the batch dict text windows give (data/packing.pack):
    inputs, targets, segment_ids, and positions restarting at 0 in each segment."""
    inputs, targets, segment_ids = rows[:, 0], rows[:, 1], rows[:, 2]
    b, n = inputs.shape
    arange = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))
    starts = np.ones((b, n), bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    last_start = np.maximum.accumulate(np.where(starts, arange, 0), axis=1)
    return {"inputs": inputs.copy(), "targets": targets.copy(),
            "segment_ids": segment_ids.copy(), "positions": (arange - last_start).astype(np.int32)}


def check_rows(rows: ExampleRows, split: str, fix: str) -> None:
    if len(rows) == 0:
        raise DataError(f"the {split} split holds no example ({rows.n_dropped} longer than "
                        f"train.seq_len+1={rows.width} tokens were dropped); {fix}")
