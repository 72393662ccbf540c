"""A shard folder of fine-tuning examples (prepare_data --format chat|prompt_response) as the
run's train and validation rows (data/example_rows.py).

The last data.val_fraction of the examples (whole examples, at least one) is held out;
data.val_fraction=0 holds out none (no validation). A run takes one example folder; text
folders and example folders never mix (a text window has no loss mask)."""

from __future__ import annotations

import pathlib

import numpy as np

from titanax.data import shards
from titanax.data.errors import DataError
from titanax.data.example_rows import ExampleRows, ExampleSet, check_rows


def is_example_folder(meta: dict) -> bool:
    return meta.get("data_format", "text") != "text"


def example_rows(cfg, folder: pathlib.Path, meta: dict, arrays: list
                 ) -> tuple[ExampleRows, ExampleRows | None, str]:
    """(train rows, validation rows or None, the log line) of an example folder."""
    masks, offsets = shards.open_example_arrays(folder, meta)
    examples = ExampleSet.from_shards(arrays, masks, offsets)
    n = len(examples)
    n_val = 0 if cfg.data.val_fraction == 0 else max(1, int(n * cfg.data.val_fraction))
    if n - n_val < 1:
        raise DataError(f"data.source: {folder} holds {n} example(s), none left for training "
                        f"after data.val_fraction={cfg.data.val_fraction}; lower it (0: no "
                        "validation) or prepare more examples")
    d, seq_len = cfg.data, cfg.train.seq_len
    seed = cfg.train.seed if d.shuffle else None
    train = ExampleRows(examples, np.arange(n - n_val), seq_len, packing=d.packing,
                        truncate=d.truncate, seed=seed)
    check_rows(train, "training", "raise train.seq_len or set data.truncate=right")
    val = None
    if n_val:
        val = ExampleRows(examples, np.arange(n - n_val, n), seq_len, packing=d.packing,
                          truncate=d.truncate)
        check_rows(val, "validation", "raise train.seq_len, data.val_fraction, or set "
                   "data.truncate=right")
    n_loss = sum(s.get("n_loss_tokens", 0) for s in meta["shards"])
    summary = (f"data: {meta['data_format']} examples {folder} (loss on {meta.get('train_on')} "
               f"tokens: {n_loss:,} of {sum(s['n_tokens'] for s in meta['shards']):,}), "
               f"data.packing={d.packing}: train {train.describe()}"
               + (f", val {val.describe()}" if val else ", no validation (data.val_fraction=0)"))
    return train, val, summary
