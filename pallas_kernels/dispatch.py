"""The one dispatch shape of the kernel ops (flash attention, fp8_matmul, grouped_matmul), as
tokamax's `Op` base gives every op one:

- a table of named implementations (each package's backends.py: flash_attention.BACKENDS,
  fp8.MATMULS, grouped_matmul.GROUPED), whose code is a "module:function" reference imported
  on first use, so a table is plain data that titanax.config reads without loading jax;
- an XLA implementation among them, the reference the others are tested against;
- `auto` resolved by the op's resolve_impl (a Hopper/Blackwell kernel where one is recorded or
  known to win, else the vendor or XLA path), every other name checked against the table;
- the config an implementation takes, a frozen dataclass validated when it is built.

This module is what the three share (no jax here): the reference loader, the impl= names and
the lookup that refuses an unknown name in the op's own words.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def loader(package: str) -> Callable[[str], object]:
    """load(ref) for an op's package: the object a "module:attribute" reference names, the
    module relative to `package` when it starts with a dot."""
    def load(ref: str):
        module, _, attr = ref.partition(":")
        return getattr(importlib.import_module(
            module, package if module.startswith(".") else None), attr)
    return load


def impl_names(table: Mapping) -> tuple[str, ...]:
    """What the op's impl= takes: 'auto' and the table's names, in table order."""
    return ("auto", *table)


def lookup(table: Mapping, name: str, unknown: Callable[[str], str]):
    """table[name]; an unknown name is a ValueError with the op's message unknown(name)."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(unknown(name)) from None
