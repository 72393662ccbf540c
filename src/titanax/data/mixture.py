"""Weighted mixtures of several shard folders (data.source=a:0.7,b:0.3).

The folders' windows are numbered one after another (folder 0's first, then folder 1's...),
so a mixture is again a window set that reads any window by index. The order is grain's:
each folder's windows are shuffled per epoch on their own seed (derived from train.seed and
the folder's position) and repeated, and `MapDataset.mix` interleaves the folders in the
weights' proportions deterministically (no sampling noise: every 1,000 windows hold the
configured shares to within grain's 1/100-of-the-smallest-weight rounding). A small folder
with a large weight simply cycles through more epochs than a large one. Everything stays a
grain MapDataset, so the iterator state is still one index and a restore resumes exactly.

Validation keeps each folder's own held-out tail and interleaves them in the same
proportions (without shuffling), so val_loss weighs the folders as training does.
"""

from __future__ import annotations

import bisect

import numpy as np


class MixtureWindows:
    """Several window sets (StreamWindows) seen as one, numbered folder after folder."""

    def __init__(self, parts: list, weights: list[float]):
        self.parts = parts
        self.weights = weights
        self.offsets = np.cumsum([0] + [len(p) for p in parts]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def rows(self, indices) -> np.ndarray:
        out = []
        for i in indices:
            k = bisect.bisect_right(self.offsets, int(i)) - 1
            out.append(self.parts[k].rows([int(i) - self.offsets[k]])[0])
        return np.stack(out)

    def _folder_datasets(self, seed: int | None, repeat: bool):
        """Per folder, a grain MapDataset of its global window indices: shuffled per epoch
        when seed is given, repeated forever when repeat."""
        import grain

        out = []
        for k, part in enumerate(self.parts):
            ds = grain.MapDataset.range(len(part))
            if seed is not None:
                ds = ds.shuffle(seed=folder_seed(seed, k))
            if repeat:
                ds = ds.repeat()
            out.append(ds.map(lambda j, off=self.offsets[k]: off + j))
        return out

    def train_order(self, seed: int, shuffle: bool):
        """The infinite, mixed grain MapDataset of window indices for training."""
        import grain

        parts = self._folder_datasets(seed if shuffle else None, repeat=True)
        return grain.MapDataset.mix(parts, self.weights)

    def val_windows(self) -> Reindexed:
        """The held-out windows interleaved in the weights' proportions (finite)."""
        import grain

        parts = self._folder_datasets(None, repeat=False)
        return Reindexed(self, grain.MapDataset.mix(parts, self.weights))


class Reindexed:
    """A window set read through an index map (window i is windows[order[i]])."""

    def __init__(self, windows, order):
        self.windows, self.order = windows, order

    def __len__(self) -> int:
        return len(self.order)

    def rows(self, indices) -> np.ndarray:
        return self.windows.rows([self.order[int(i)] for i in indices])


def folder_seed(seed: int, k: int) -> int:
    """The shuffle seed of folder k: distinct per folder, a pure function of train.seed."""
    return int(np.random.SeedSequence([seed % 2**32, k]).generate_state(1)[0])
