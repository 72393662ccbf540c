"""A shard folder of fine-tuning examples (prepare_data --format chat|prompt_response) as the
run's train and validation rows (data/example_rows.py).

The last data.val_fraction of the examples (whole examples, at least one) is held out;
data.val_fraction=0 holds out none (no validation). A run takes one example folder; text
folders and example folders never mix (a text window has no loss mask).

Small sets (a few hundred chats): the held-out share never takes more than a tenth of the
examples (the one-example minimum included), and never leaves training fewer rows than one
batch of train.batch_size: the split shrinks (to none if it must) and the log says so in one
line. A folder whose examples cannot fill one training batch at all is refused in one line
naming the counts and the fix: batches would repeat rows (a "3 epoch" run of 2 rows at batch
16 was 1 step showing every row 8 times). A validation split too small for one batch is
evaluated in a smaller batch (pipeline.Data.val_batches)."""

from __future__ import annotations

import pathlib

import numpy as np

from titanax.data import shards
from titanax.data.errors import DataError
from titanax.data.example_rows import ExampleRows, ExampleSet, check_rows


def is_example_folder(meta: dict) -> bool:
    return meta.get("data_format", "text") != "text"


def example_rows(cfg, folder: pathlib.Path, meta: dict, arrays: list, *, alone: bool = True
                 ) -> tuple[ExampleRows, ExampleRows | None, str]:
    """(train rows, validation rows or None, the log line(s)) of an example folder. alone: the
    run's only folder (a mixture's folders cycle by weight, so one may hold less than a batch)."""
    masks, offsets = shards.open_example_arrays(folder, meta)
    examples = ExampleSet.from_shards(arrays, masks, offsets)
    n = len(examples)
    d, seq_len, batch = cfg.data, cfg.train.seq_len, cfg.train.batch_size
    seed = cfg.train.seed if d.shuffle else None

    def train_rows(n_val: int) -> ExampleRows:
        return ExampleRows(examples, np.arange(n - n_val), seq_len, packing=d.packing,
                           truncate=d.truncate, seed=seed)

    asked = 0 if d.val_fraction == 0 else max(1, int(n * d.val_fraction))
    n_val = capped = min(asked, n // 10)  # never more than a tenth of the examples
    if n - n_val < 1:
        raise DataError(f"data.source: {folder} holds {n} example(s), none left for training "
                        f"after data.val_fraction={d.val_fraction}; lower it (0: no "
                        "validation) or prepare more examples")
    train = train_rows(n_val)
    check_rows(train, "training", "raise train.seq_len or set data.truncate=right")
    notes = []
    if alone and len(train) < batch:
        whole = train_rows(0) if n_val else train
        if len(whole) < batch:
            raise DataError(_too_few(folder, whole, n, examples, cfg))
        lo, hi = 0, n_val  # the most examples held out that leave a full batch: bisect
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if len(train_rows(mid)) >= batch else (lo, mid)
        n_val, train = lo, train_rows(lo) if lo else whole
    if n_val < asked:
        why = ("a tenth of the examples" if n_val == capped else
               f"what leaves training one batch of train.batch_size={batch} rows")
        notes.append(f"data: validation holds {n_val} of {n} examples, not the {asked} "
                     f"data.val_fraction={d.val_fraction:g} asks for: at most {why}"
                     + ("; no validation" if n_val == 0 else ""))
    val = None
    if n_val:
        val = ExampleRows(examples, np.arange(n - n_val, n), seq_len, packing=d.packing,
                          truncate=d.truncate)
        check_rows(val, "validation", "raise train.seq_len, data.val_fraction, or set "
                   "data.truncate=right")
    n_loss = sum(s.get("n_loss_tokens", 0) for s in meta["shards"])
    none = ("no validation (data.val_fraction=0)" if d.val_fraction == 0 else
            "no validation")
    summary = (f"data: {meta['data_format']} examples {folder} (loss on {meta.get('train_on')} "
               f"tokens: {n_loss:,} of {sum(s['n_tokens'] for s in meta['shards']):,}), "
               f"data.packing={d.packing}: train {train.describe()}"
               + (f", val {val.describe()}" if val else f", {none}"))
    return train, val, "\n  ".join([summary, *notes])


def _too_few(folder, rows: ExampleRows, n: int, examples: ExampleSet, cfg) -> str:
    """The refusal of a folder whose examples fill fewer rows than one training batch."""
    d, t = cfg.data, cfg.train
    longest = int(examples.length.max(initial=0))
    fixes = [f"lower train.batch_size to {len(rows)} or less"]
    if d.packing == "pack":  # several examples a row: shorter rows, or one a row, are more
        if longest < t.seq_len + 1:
            fixes.append(f"lower train.seq_len (the examples hold "
                         f"{int(examples.length.sum()):,} tokens, the longest {longest})")
        if n - rows.n_dropped >= t.batch_size:
            fixes.append(f"set data.packing=pad (one example a row: {n - rows.n_dropped} rows)")
    fixes.append("prepare more examples")
    return (f"data.source: {folder} holds {n} example(s) in {len(rows)} row(s) of "
            f"train.seq_len+1={t.seq_len + 1} tokens (data.packing={d.packing}), fewer than "
            f"one batch of train.batch_size={t.batch_size}: every step would repeat rows; "
            + ", ".join(fixes[:-1]) + f", or {fixes[-1]}")
