"""Packing a token stream into fixed training windows.

The stream is documents concatenated, each followed by eos. Window i is the tokens
[i * (seq_len + 1), (i + 1) * (seq_len + 1)): windows do not overlap (the stride is
seq_len + 1, so every token is a target exactly once, except each window's first token,
which is input only), and the tail that cannot fill a window is dropped.

Per window: inputs = w[:-1], targets = w[1:], and for document masking segment_ids (documents
numbered from 1 inside the window; a document starts right after an eos input) and positions
(restarting at 0 at each document start). A window starts mid-document at segment 1,
position 0: the model sees a fresh context there anyway.
"""

from __future__ import annotations

import bisect

import numpy as np


class TokenStream:
    """A read-only view of several 1-D token arrays (e.g. memory-mapped shards) as one.

    Nothing is concatenated in memory: `read` copies only the requested range, so streams of
    many GB cost nothing until windows are gathered.
    """

    def __init__(self, parts: list[np.ndarray], start: int = 0, stop: int | None = None, *,
                 names: list[str] | None = None, vocab_size: int | None = None):
        """names: each part's file (shard), for errors; vocab_size: every id read must be
        below it. A shard's recorded max_id is checked at start-up without reading tokens;
        this catches what a stale record misses (a flipped bit), naming the file, before the
        id reaches the model (one wrong id trains silently, more end in NaN)."""
        keep = [i for i, p in enumerate(parts) if len(p)]
        self._parts = [parts[i] for i in keep]
        self._names = [names[i] for i in keep] if names is not None else None
        self._vocab_size = vocab_size
        self._offsets = np.cumsum([0] + [len(p) for p in self._parts]).tolist()
        total = self._offsets[-1]
        self._start = start
        self._stop = total if stop is None else stop
        if not 0 <= self._start <= self._stop <= total:
            raise ValueError(f"bad stream range [{start}, {stop}) of {total} tokens")

    def __len__(self) -> int:
        return self._stop - self._start

    def view(self, start: int, stop: int) -> TokenStream:
        """The sub-stream [start, stop) of this stream, without copying."""
        return TokenStream(self._parts, self._start + start, self._start + stop,
                           names=self._names, vocab_size=self._vocab_size)

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) of this stream as a fresh array (may span parts)."""
        if start < 0 or start + n > len(self):
            raise IndexError(f"read [{start}, {start + n}) outside a stream of {len(self)}")
        if n == 0:
            return np.zeros(0, self._parts[0].dtype if self._parts else np.uint32)
        lo = self._start + start
        hi = lo + n
        pieces = []
        k = bisect.bisect_right(self._offsets, lo) - 1
        while lo < hi:
            part_lo = self._offsets[k]
            take = min(hi, self._offsets[k + 1]) - lo
            piece = self._parts[k][lo - part_lo: lo - part_lo + take]
            if self._vocab_size is not None and piece.max() >= self._vocab_size:
                self._out_of_range(k, lo - part_lo, piece)
            pieces.append(piece)
            lo += take
            k += 1
        return np.concatenate(pieces) if len(pieces) > 1 else np.array(pieces[0])

    def _out_of_range(self, k: int, at: int, piece: np.ndarray) -> None:
        from titanax.data.errors import DataError

        i = int(np.argmax(piece >= self._vocab_size))
        name = self._names[k] if self._names else f"token array {k}"
        raise DataError(f"{name}: token id {int(piece[i])} at token {at + i:,} is outside "
                        f"[0, model.vocab_size={self._vocab_size}), though the folder's "
                        "meta.json recorded a smaller max_id: the file is damaged (or was "
                        "rewritten by hand); re-run `python -m launch.prepare_data` into a "
                        "fresh --out folder")

    def to_array(self) -> np.ndarray:
        return self.read(0, len(self))


class StreamWindows:
    """Windows of seq_len + 1 tokens cut from a TokenStream."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream = stream
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.stream) // (self.seq_len + 1)

    def rows(self, indices) -> np.ndarray:
        w = self.seq_len + 1
        # One slice per row (not per token): rows are few, tokens many.
        return np.stack([self.stream.read(int(i) * w, w) for i in indices])


def pack(windows: np.ndarray, eos_id: int | None, document_masking: bool = True) -> dict:
    """[B, seq_len + 1] token windows -> dict of int32 [B, seq_len] arrays.

    Keys: inputs, targets, segment_ids, positions. With document_masking off (or no eos,
    as for synthetic data) every row is one segment with positions 0..seq_len-1.
    """
    windows = np.asarray(windows)
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"pack expects [batch, seq_len + 1] windows, got shape {windows.shape}")
    inputs = windows[:, :-1].astype(np.int32)
    targets = windows[:, 1:].astype(np.int32)
    b, n = inputs.shape
    arange = np.broadcast_to(np.arange(n, dtype=np.int32), (b, n))
    if not document_masking or eos_id is None:
        return {"inputs": inputs, "targets": targets,
                "segment_ids": np.ones((b, n), np.int32), "positions": arange.copy()}
    # A document starts at j > 0 when the input before it is eos.
    starts = np.zeros((b, n), bool)
    starts[:, 1:] = inputs[:, :-1] == eos_id
    segment_ids = 1 + np.cumsum(starts, axis=1, dtype=np.int32)
    # Position = distance to the latest document start at or before j (0 for the window start).
    last_start = np.maximum.accumulate(np.where(starts, arange, 0), axis=1)
    positions = (arange - last_start).astype(np.int32)
    return {"inputs": inputs, "targets": targets, "segment_ids": segment_ids,
            "positions": positions}
