"""The config's one error type and the per-field checks every section runs in __post_init__."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing


class ConfigError(ValueError):
    """A configuration problem the user must fix; the message says which field and how."""


def fail(field_name: str, msg: str) -> None:
    raise ConfigError(f"{field_name}: {msg}")


def check_choice(field_name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        close = difflib.get_close_matches(value, choices, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        fail(field_name, f"{value!r} is not one of {list(choices)}.{hint}")


@functools.cache
def type_hints(cls) -> dict[str, type]:
    # Resolving the string annotations is slow (they are compiled); the planner's search
    # builds thousands of configs.
    return typing.get_type_hints(cls)


def check_types(section: str, obj) -> None:
    """Field types as declared (ints accepted for floats), whatever built the object: a Python
    config, gin, --set or a checkpoint's JSON."""
    hints = type_hints(type(obj))
    for f in dataclasses.fields(obj):
        typ = hints[f.name]
        value = getattr(obj, f.name)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(obj, f.name, float(value))
            continue
        if typ is float and isinstance(value, float) and not math.isfinite(value):
            # optim.lr=nan trains NaN weights and saves them: no float knob means inf or nan.
            fail(f"{section}.{f.name}", f"must be a finite number, got {value!r}")
        if isinstance(value, bool) and typ is not bool or not isinstance(value, typ):
            fail(f"{section}.{f.name}", f"expected {type_name(typ)}, got "
                 f"{type(value).__name__} {value!r}")


def type_name(typ) -> str:
    return getattr(typ, "__name__", None) or str(typ)  # 'int | str' for a union


def check_positive(section: str, obj, *names: str) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            fail(f"{section}.{name}", f"must be > 0, got {getattr(obj, name)}")
