"""--set section.field=value: each value coerced to its field's type (strings from the command
line, Python values from code), unknown keys answered with the closest one. model.* keys are
the fields of model.arch's class (set model.arch in the same call to switch architecture);
model.<execution field> is an alias of execution.<field> (DESIGN.md's names)."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing

from titanax.config.errors import ConfigError, type_hints, type_name
from titanax.config.model import EXECUTION_FIELDS, arch_config_class, as_arch_class
from titanax.config.rules import SECTIONS, Config

# Written before the execution section existed, and still what users type.
EXECUTION_ALIASES = {f"model.{name}": f"execution.{name}" for name in EXECUTION_FIELDS}


def _field_types(cls) -> dict[str, type]:
    hints = type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def closest_key(key: str, model_cls: type | None = None) -> str:
    section, _, name = key.partition(".")
    if section in SECTIONS:  # a known section: the field is the likely typo
        cls = model_cls if section == "model" and model_cls else SECTIONS[section]
        names = [f.name for f in dataclasses.fields(cls)]
        names += list(EXECUTION_FIELDS) if section == "model" else []  # the aliases
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
        if close:
            return f" Did you mean '{section}.{close[0]}'?"
    all_keys = [f"{s}.{f.name}" for s, c in SECTIONS.items() for f in dataclasses.fields(c)]
    close = difflib.get_close_matches(key, all_keys, n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else ""


def _coerce(key: str, raw, typ: type):
    """Turns an override value (a string from the command line, or a Python value) into typ."""
    if isinstance(typ, types.UnionType):  # int | str (train.grad_accum=4 or auto): a number
        if isinstance(raw, str):          # when it reads as one, else the text
            try:
                return _coerce(key, raw, int)
            except ConfigError:
                return raw.strip()
        if isinstance(raw, bool) or not isinstance(raw, typ):
            raise ConfigError(f"{key}: expected {type_name(typ)}, got {type(raw).__name__} "
                              f"{raw!r}")
        return raw
    if isinstance(raw, str):
        text = raw.strip()
        if typ is bool:
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{key}: expected a boolean (true/false), got {raw!r}")
        if typ is int:
            try:
                return int(text.replace("_", ""))
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    raise ConfigError(f"{key}: expected an integer, got {raw!r}") from None
                if value.is_integer():
                    return int(value)
                raise ConfigError(f"{key}: expected an integer, got {raw!r}") from None
        if typ is float:
            try:
                return float(text)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {raw!r}") from None
        if typ is str:
            return text
    if typ is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if typ is bool and not isinstance(raw, bool):
        raise ConfigError(f"{key}: expected a boolean, got {type(raw).__name__} {raw!r}")
    if typ in (int, float) and isinstance(raw, bool):
        raise ConfigError(f"{key}: expected {typ.__name__}, got a boolean")
    if not isinstance(raw, typ):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {type(raw).__name__} {raw!r}")
    if typ is float and not math.isfinite(raw):
        raise ConfigError(f"{key}: must be a finite number, got {raw!r}")
    return raw


def parse_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.field=value, e.g. train.steps=100")
    key, value = text.split("=", 1)
    return key.strip(), value


# Pairs where the second field, when set (not its "off" value), decides instead of the first:
# train.epochs > 0 sets train.steps from the data, optim.warmup_fraction > 0 replaces
# optim.warmup_steps. An override of the first over a config that sets the second (a run's
# saved config.json: train.epochs=5 there beat --set train.steps=50 and trained to step 602)
# turns the second off, and says so: the field the user typed is the one that counts.
RIVALS: dict[str, tuple[str, typing.Any]] = {
    "train.steps": ("train.epochs", 0.0),
    "optim.warmup_steps": ("optim.warmup_fraction", 0.0),
}


def _shown(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def settle_rivals(cfg: Config, overrides: dict[str, typing.Any],
                  base: str = "the config's") -> tuple[dict[str, typing.Any], list[str]]:
    """(overrides with the rival fields RIVALS turns off added, one line per rival turned off,
    e.g. "--set train.steps=50 replaces the saved train.epochs=5"). base: how the lines name
    cfg ("the saved", "the config's")."""
    out, lines = dict(overrides), []
    for key, (rival, off) in RIVALS.items():
        if key not in overrides or rival in overrides:
            continue
        section, name = rival.split(".")
        current = getattr(getattr(cfg, section), name)
        if current != off:
            out[rival] = off
            raw = overrides[key]
            lines.append(f"--set {key}={_shown(raw) if not isinstance(raw, str) else raw.strip()}"
                         f" replaces {base} {rival}={_shown(current)}")
    return out, lines


def apply_overrides(cfg: Config, overrides: typing.Mapping[str, typing.Any] | typing.Iterable[str],
                    *, notes: list[str] | None = None, base: str = "the config's") -> Config:
    """Applies {'train.steps': '300'} or ['train.steps=300'] to cfg; validates the result. An
    override whose rival field cfg sets (RIVALS) turns that off; notes, when given, gets the
    line saying so (base names cfg in it)."""
    if not isinstance(overrides, typing.Mapping):
        overrides = dict(parse_override(o) for o in overrides)
    overrides = {EXECUTION_ALIASES.get(k.strip(), k.strip()): v for k, v in overrides.items()}
    overrides, lines = settle_rivals(cfg, overrides, base)
    if notes is not None:
        notes.extend(lines)
    arch = overrides.get("model.arch", cfg.model.arch)
    model_cls = arch_config_class(arch.strip() if isinstance(arch, str) else arch)
    per_section: dict[str, dict] = {}
    for key, raw in overrides.items():
        parts = key.split(".")
        if len(parts) != 2 or parts[0] not in SECTIONS:
            raise ConfigError(f"unknown config key {key!r}: keys look like section.field with "
                              f"section one of {list(SECTIONS)}.{closest_key(key, model_cls)}")
        section, name = parts
        types_ = _field_types(model_cls if section == "model" else SECTIONS[section])
        if name not in types_:
            where = f" ({model_cls.arch} has no such field)" if section == "model" else ""
            raise ConfigError(f"unknown config key {key!r}{where}.{closest_key(key, model_cls)}")
        per_section.setdefault(section, {})[name] = _coerce(key, raw, types_[name])
    sections = {s: as_arch_class(cfg.model, **v) if s == "model" else
                dataclasses.replace(getattr(cfg, s), **v) for s, v in per_section.items()}
    return dataclasses.replace(cfg, **sections)
