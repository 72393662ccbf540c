"""Loads a task's JSONL file from this folder as a datasets.DatasetDict, with no dataset hub
and no datasets cache: lm-eval's `custom_dataset: !function local_data.load` calls it with the
task's dataset_kwargs (`file`, `split`) and metadata. Imports nothing from titanax, so that
lm-eval in another environment (the PyTorch peer's `hf` model) can load the same tasks."""

import json
import pathlib


def load(file: str, split: str = "test", **_metadata):
    import datasets

    path = pathlib.Path(__file__).resolve().parent / file
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})
