"""Sizes in bytes as users write them (train.device_memory_limit, launch.plan --memory)."""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str) -> int:
    """A size in bytes from 123, '123', '80GB' (10^9) or '76.5GiB' (2^30); '' is 0."""
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)\s*", value.lower())
        if value.strip() and (not m or m[2] not in _SIZE_UNITS):
            raise ValueError(f"{value!r} is not a size: give bytes or e.g. '80GB', '76.5GiB'")
        n = int(float(m[1]) * _SIZE_UNITS[m[2]]) if value.strip() else 0
    if n < 0:
        raise ValueError(f"must be >= 0 (0: the devices' own), got {value!r}")
    return n
