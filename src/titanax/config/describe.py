"""`launch.train --help-config`: every config field as `section.field = default  # what it is`
(with --config, --set or a run's --workdir: that config's values instead),
the one line taken from the comment written beside the field in its dataclass (the source is
the documentation; a field without one shows its default alone). The model section lists the
fields every architecture has, then each architecture's own."""

from __future__ import annotations

import dataclasses
import inspect
import io
import re
import tokenize

from titanax.archs import ARCHS
from titanax.config.model import EXECUTION_FIELDS, ModelConfig, arch_config_class
from titanax.config.rules import SECTIONS


def field_comments(cls) -> dict[str, str]:
    """{field: its comment} for every field of dataclass cls, each read from the source of the
    class that declares it (cls or a base, e.g. config/moe.py's MoEModelConfig for Mixtral's
    fields): a trailing `# ...` on the field's line, else the block of `#` lines right above
    it (its first sentence)."""
    out: dict[str, str] = {}
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass):
            for name, text in _own_comments(klass).items():
                out.setdefault(name, text)
    return out


def _own_comments(cls) -> dict[str, str]:
    """field_comments of the fields declared in cls's own source."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for f in dataclasses.fields(cls):
        row = next((i + 1 for i, line in enumerate(lines)
                    if re.match(rf"\s+{f.name}\s*:", line)), None)
        if row is None:  # inherited: its own class's source describes it
            continue
        text = comments.get(row) if not lines[row - 1].lstrip().startswith("#") else None
        if text is None:
            above, i = [], row - 1
            while i in comments and lines[i - 1].lstrip().startswith("#"):
                above.insert(0, comments[i])
                i -= 1
            text = " ".join(above)
        out[f.name] = _first_sentence(text)
    return out


def _first_sentence(text: str) -> str:
    head = re.split(r"(?<=\.)\s", text, maxsplit=1)[0] if text else ""
    return head if len(head) <= 120 else head[:117] + "..."


def _rows(section: str, cls, names=None, values=None) -> list[str]:
    """One line per field of cls: its default, or with values (the section's instance) its
    value there, the default added where they differ."""
    notes = field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown, note = default, notes.get(f.name, "")
        if values is not None:
            shown = getattr(values, f.name)
            if shown != default:
                note = f"(default {default!r}) {note}".rstrip()
        rows.append(f"  {section}.{f.name} = {shown!r}" + (f"  # {note}" if note else ""))
    return rows


def describe_config(cfg=None, source: str = "") -> str:
    """Every section's fields with their defaults and one line each (see the module doc); with
    cfg (a Config), its values instead, for the model section its architecture's fields only.
    source: where cfg came from, for the first line."""
    out = [f"# the values of {source or 'this config'} (fields set away from their default "
           "name it)"] if cfg is not None else []
    for section, cls in SECTIONS.items():
        if cfg is not None:
            values = getattr(cfg, section)
            out.append(f"[{section}]" + (f"  (model.arch={values.arch}: "
                                         f"{type(values).__name__})" if section == "model"
                                         else ""))
            out += _rows(section, type(values), values=values)
            continue
        out.append(f"[{section}]" + ("  (model.arch picks the class; every architecture has "
                                     "these)" if section == "model" else ""))
        out += _rows(section, cls)
        if section == "model":
            base = {f.name for f in dataclasses.fields(ModelConfig)}
            for arch in ARCHS:
                arch_cls = arch_config_class(arch)
                own = [f.name for f in dataclasses.fields(arch_cls) if f.name not in base]
                if own:
                    out.append(f"  (model.arch={arch} adds)")
                    out += _rows(section, arch_cls, own)
        if section == "execution":
            out.append(f"  (also settable as model.<field>: {', '.join(EXECUTION_FIELDS)})")
    return "\n".join(out)
