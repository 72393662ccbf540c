"""data.source as text: a named source, one folder of token shards or a weighted mixture of
folders ('a:0.7,b:0.3'). Kept as one string so checkpoints, --set and Python configs agree."""

from __future__ import annotations

import math

from titanax.config.errors import fail

SOURCE_UNSET = "unset"  # data.source of a run that has none yet (an import)


def mixture_string(pairs) -> str:
    """[("a", 0.7), ("b", 0.3)] or {"a": 0.7, "b": 0.3} -> 'a:0.7,b:0.3' (data.source)."""
    items = list(pairs.items()) if isinstance(pairs, dict) else list(pairs)
    parts = []
    for item in items:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not isinstance(item[0], str) or isinstance(item[1], bool)
                or not isinstance(item[1], (int, float))):
            fail("data.source", f"mixture entry {item!r} is not a (folder, weight) pair; write "
                 "e.g. [('shards/web', 0.7), ('shards/code', 0.3)]")
        parts.append(f"{item[0]}:{float(item[1])!r}")
    return ",".join(parts)


def _weight(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_source(source: str) -> list[tuple[str, float]]:
    """data.source -> [(folder, weight), ...]; see DataConfig.folders."""
    if source in ("embedded", "synthetic", SOURCE_UNSET):
        return []
    items = [item.strip() for item in source.split(",")]
    split = [item.rpartition(":") for item in items]
    weighted = [sep and _weight(w) is not None for _, sep, w in split]
    if not any(weighted):  # no 'folder:weight' at all: one folder (its name may hold ',')
        return [(source, 1.0)]
    pairs = []
    for item, (folder, _, w), ok in zip(items, split, weighted):
        weight = _weight(w) if ok else None
        if not ok or not folder or weight is None or not math.isfinite(weight) or weight <= 0:
            fail("data.source", f"mixture entry {item!r} is not folder:weight with a weight "
                 "> 0; write e.g. data.source=shards/web:0.7,shards/code:0.3")
        if folder in ("embedded", "synthetic"):
            fail("data.source", f"a mixture is of token shard folders, not {folder!r}; write "
                 "the text with `python -m launch.prepare_data` and mix the folder")
        if folder in [f for f, _ in pairs]:
            fail("data.source", f"{folder!r} appears twice in the mixture; give it once, "
                 "with the sum of its weights")
        pairs.append((folder, weight))
    return pairs
