"""A Hugging Face dataset by name (prepare_data --hf-dataset NAME [--split] [--config]), read
through `datasets.load_dataset(..., streaming=True)`: rows arrive as the data files are
streamed, nothing is downloaded whole first. NAME is a Hub id (org/name) or anything else
load_dataset takes, a local folder of data files included.

Its rows are records as a table's are (readers.py): counted from 1, the text under --text-key
or the fields of --format, and a resumed run skips the rows already in listed shards.
"""

from __future__ import annotations

import os

from titanax.data.errors import DataError

_OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


class HFDataset:
    """One split of a dataset by name; loaded (streaming) on first use, once."""

    def __init__(self, name: str, split: str = "train", config: str | None = None):
        self.name, self.split, self.config = name, split, config
        self._stream = None

    def __str__(self) -> str:
        # Messages add ":row" (as to a file's "path:line"), meta.json records it as the source.
        config = f" ({self.config})" if self.config else ""
        return f"{self.name}{config}[{self.split}]"

    def __truediv__(self, split: str) -> HFDataset:
        # The dataset is its own root, its split the one input: root / rel names it.
        return self

    def option(self) -> str:
        """The command-line options that name it."""
        config = f" --config {self.config}" if self.config else ""
        return f"--hf-dataset {self.name}{config} --split {self.split}"

    def rows(self, skip: int = 0):
        """The split's rows (dicts) after the first skip. Resuming reads and drops the
        skipped rows: a stream has no random access."""
        stream = self._load()
        return iter(stream.skip(skip) if skip else stream)

    def _load(self):
        if self._stream is None:
            try:
                import datasets
            except ImportError:
                raise DataError(f"{self.option()}: needs the `datasets` package; pip install "
                                "datasets") from None
            try:
                self._stream = datasets.load_dataset(self.name, self.config, split=self.split,
                                                     streaming=True)
            except Exception as e:  # datasets' own types: bad split or config, not found, ...
                raise DataError(self._load_error(e)) from None
        return self._stream

    def _load_error(self, e: Exception) -> str:
        """The one line for a load that failed: offline without a cached copy, not found, or
        datasets' own message (a bad split or config names the ones there are)."""
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, ConnectionError):
            offline = [v for v in _OFFLINE if os.environ.get(v, "").lower() in ("1", "true")]
            why = (f"{'/'.join(offline)} is set" if offline else
                   "the Hugging Face Hub cannot be reached")
            cache = os.environ.get("HF_HOME", "~/.cache/huggingface")
            return (f"{self.option()}: {why} and HF_HOME={cache} holds no copy ({text}); "
                    "run it once with network access (unset HF_DATASETS_OFFLINE and "
                    "HF_HUB_OFFLINE) or point HF_HOME at a cache that has it, or pass a local "
                    "folder of its data files as the name")
        if isinstance(e, FileNotFoundError):
            return (f"{self.option()}: not found ({text}); check the name (org/name on the "
                    "Hub, or a local folder), and HF_TOKEN for a private or gated dataset")
        return f"{self.option()}: {type(e).__name__}: {text}; check --split and --config"
