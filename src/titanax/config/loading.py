"""A Config from a file: a .py defining config(), a .gin binding the sections, or a run's
config.json; then the --set overrides. Each error names the file, the line where known, and
the fix."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import pathlib
import re
import typing
import warnings

from titanax.config.errors import ConfigError
from titanax.config.execution import ExecutionConfig
from titanax.config.model import EXECUTION_FIELDS, ModelConfig, as_arch_class, model_field_names
from titanax.config.overrides import apply_overrides, closest_key
from titanax.config.rules import SECTIONS, Config, sections_of_old_dict

# Sections whose gin bindings are collected as keyword arguments and applied like --set: the
# model section's fields depend on model.arch, and model.<execution field> is an alias.
_GIN_AS_OVERRIDES = ("model", "execution")


def _collect(**kwargs) -> dict:
    return kwargs


def _load_py(path: pathlib.Path) -> Config:
    spec = importlib.util.spec_from_file_location(f"titanax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "config"):
            raise ConfigError(f"{path}: a Python config must define config() returning "
                              "titanax.config.Config")
        cfg = module.config()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's file: one line naming where it broke
        raise ConfigError(f"{path}{_where_in(e, path)}: {type(e).__name__}: {e}") from None
    if not isinstance(cfg, Config):
        raise ConfigError(f"{path}: config() returned {type(cfg).__name__}, expected "
                          "titanax.config.Config")
    return cfg


def _where_in(e: BaseException, path: pathlib.Path) -> str:
    """':LINE' of the deepest frame of e's traceback inside path ('' when none is)."""
    if isinstance(e, SyntaxError) and e.lineno:
        return f":{e.lineno}"
    line = ""
    tb = e.__traceback__
    while tb is not None:
        if pathlib.Path(tb.tb_frame.f_code.co_filename).resolve() == path.resolve():
            line = f":{tb.tb_lineno}"
        tb = tb.tb_next
    return line


def _load_gin(path: pathlib.Path) -> Config:
    import tokenize

    import gin

    gin.clear_config()
    configurables = {}
    for name, cls in SECTIONS.items():
        target = _collect if name in _GIN_AS_OVERRIDES else cls
        configurables[name] = gin.external_configurable(target, name=name, module="titanax")
    try:
        gin.parse_config_file(str(path), skip_unknown=False)
    except SyntaxError as e:  # gin's parser: a malformed statement or value
        raise ConfigError(f"{path}:{e.lineno}: {e.msg}") from None
    except tokenize.TokenError as e:  # Python's tokenizer under gin: unclosed bracket or quote
        line = e.args[1][0] if len(e.args) > 1 else "?"
        raise ConfigError(f"{path}:{line}: {e.args[0]}") from None
    except (ValueError, KeyError) as e:  # gin's messages name the binding; add the closest key
        msg = str(e)
        hint = ""
        quoted = re.findall(r"'([\w.]+)'", msg)  # gin quotes the configurable, then the parameter
        if len(quoted) >= 2 and quoted[0] in SECTIONS:
            hint = closest_key(f"{quoted[0]}.{quoted[1]}")
        elif quoted and quoted[0] not in SECTIONS:
            close = difflib.get_close_matches(quoted[0], list(SECTIONS), n=1)
            hint = f" Sections are {list(SECTIONS)}." + (f" Did you mean {close[0]!r}?" if close else "")
        raise ConfigError(f"{path}: {msg.splitlines()[0]}{hint}") from None
    try:
        made = {name: make() for name, make in configurables.items()}
        bound = sections_of_old_dict({name: made.pop(name) for name in _GIN_AS_OVERRIDES})
        unknown = [k for k in bound["execution"] if k not in EXECUTION_FIELDS]
        if unknown:
            raise ConfigError(f"unknown config key 'execution.{unknown[0]}'."
                              f"{closest_key('execution.' + unknown[0])}")
        return Config(model=as_arch_class(ModelConfig(), **bound["model"]),
                      execution=ExecutionConfig(**bound["execution"]), **made)
    except ConfigError as e:  # gin appends "In call to configurable ..." lines; keep ours
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None
    finally:
        gin.clear_config()


def _load_json(p: pathlib.Path) -> Config:
    """A run's config.json (what launch.train and the HF import write into a workdir): the
    sections as Config.to_dict() gives them. Fields this version does not know (a run of
    another version) are left out with a warning naming them."""
    try:
        d = json.loads(p.read_text())
    except ValueError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid JSON: {e}") from None
    if not isinstance(d, dict) or not d or set(d) - set(SECTIONS):
        extra = sorted(set(d) - set(SECTIONS)) if isinstance(d, dict) else type(d).__name__
        raise ConfigError(f"config file {str(p)!r}: expected a run's config.json, an object "
                          f"of the sections {', '.join(SECTIONS)}; got {extra or 'nothing'}")
    d = sections_of_old_dict(d)
    arch = (d.get("model") or {}).get("arch", "llama3")
    known = {name: (model_field_names(arch) if name == "model" else
                    [f.name for f in dataclasses.fields(section_cls)])
             for name, section_cls in SECTIONS.items()}
    unknown = [f"{name}.{k}" for name in SECTIONS for k in (d.get(name) or {})
               if k not in known[name]]
    if unknown:
        warnings.warn(f"{p}: fields this titanax does not have, left out: {', '.join(unknown)}",
                      stacklevel=3)
    try:
        return Config.from_dict(d)
    except TypeError as e:
        raise ConfigError(f"config file {str(p)!r}: {e}") from None


def load_config(path: str | pathlib.Path | None = None,
                overrides: typing.Iterable[str] | typing.Mapping[str, typing.Any] = (), *,
                notes: list[str] | None = None) -> Config:
    """Reads a .py (defining config()) or .gin file, or a run's config.json, then applies --set
    overrides (an override turns off the field that would decide instead of it, config/
    overrides.py RIVALS; notes, when given, gets the line saying so)."""
    if path is None:
        cfg = Config()
    else:
        p = pathlib.Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist (configs/ has tiny.py, "
                              "llama3_8b.py, llama3_70b.py, llama3_405b.py and .gin twins)")
        if p.suffix == ".py":
            cfg = _load_py(p)
        elif p.suffix == ".gin":
            cfg = _load_gin(p)
        elif p.suffix == ".json":
            cfg = _load_json(p)
        else:
            raise ConfigError(f"config file {str(p)!r}: expected a .py or .gin file, or a "
                              "run's config.json")
    try:
        return apply_overrides(cfg, overrides, notes=notes, base=(
            "the saved" if path is not None and pathlib.Path(path).suffix == ".json" else
            "the config's"))
    except TypeError as e:  # dataclasses.replace with a wrong type slips through as TypeError
        raise ConfigError(str(e)) from None


def format_config(cfg: Config) -> str:
    lines = []
    for name in SECTIONS:
        section = getattr(cfg, name)
        vals = ", ".join(f"{f.name}={getattr(section, f.name)!r}" for f in dataclasses.fields(section))
        lines.append(f"  {name}: {vals}")
    return "\n".join(lines)
