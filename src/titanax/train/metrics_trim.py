"""metrics.jsonl of a restarted run: the rows it is about to write again are dropped first."""

from __future__ import annotations

import json
import pathlib


def drop_metrics_from(workdir: pathlib.Path, step: int) -> None:
    """A restarted run writes again the rows from `step` on (it repeats the steps after its
    checkpoint, or everything when it starts over): drop the old ones, and any row a kill cut
    short, so metrics.jsonl holds each step once, as an uninterrupted run writes it."""
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] < step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            pass
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    tmp.replace(path)
